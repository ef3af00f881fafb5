// Depthwise convolution on the tensor cores (dwconv.h, `kernel` 2): the forward and the input gradient of
// float16 / bfloat16 inputs as products of Toeplitz matrices, on sm_90.
//
// For one channel and kernel row i, the outputs of a 16-row x 8-column block are one mma.m16n8k16:
//   acc[r][n] += sum_k A_i[r][k] * B_i[k][n],  A_i[r][k] = x[r + i][8g + k] (16 rows x 16 staged columns),
//   B_i[k][n] = tap[i][k - n] where 0 <= k - n < K, else 0,
// so K products per block replace K * K FMAs per output. The taps are float32; each B_i is issued twice, as
// the taps rounded to 16 bits and as the rounding's remainder, so the products see the taps to about 16
// bits. Accumulation is float32. `add_input` adds 1 to the centre tap (x + conv(x) as one convolution).
//
// A CTA owns 32 channels of a tile of 16 output rows x 8 * NT columns and loops over tiles (persistent,
// double-buffered like the tile kernels): TMA stages the tile's input with its halo as four boxes of 8
// channels ([row][column][8 channels]); ldmatrix.trans / stmatrix turn them into one [channel][row][column]
// plane per channel, from which ldmatrix loads the A fragments; each warp keeps the B fragments of its two
// channels in registers for the CTA's life. The products leave through a second [channel][row][column]
// plane, transposed back by ldmatrix.trans into 4-byte stores of two channels. Every pitch is an odd number
// of 16-byte units, so no ldmatrix or stmatrix has a bank conflict.
//
// The weight gradient runs the same way with the roles turned: for kernel row i, D_i[k][n] = sum_r x[r + i][8g + k]
// * grad_y[r][8g + n] is one mma per 16 x 8 block (A: the input plane read transposed, B: grad_y's plane), summed
// over the CTA's tiles in registers; tap (i, j) of the gradient is the sum of D_i along the diagonal k - n = j,
// taken once per CTA in a fixed order, and the bias gradient is one more product with a matrix of ones. The
// CTAs' partial sums are added in a fixed order by the tile kernels' reduce pass (deterministic).
//
// Inputs that are not finite reach more outputs than in a direct convolution: a product of inf or NaN with a
// zero of B is NaN, so such an input poisons the 8-column block of every output row whose window holds it.
#include <algorithm>
#include <climits>

#include "dwconv_tile.cuh"

namespace gspn2 {
namespace {

constexpr int kMmaWarps = 16;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaRows = 16;  // output rows per tile: the products' M
constexpr int kMmaSmemMax = 227 * 1024;  // an sm_90 block's shared memory (opt-in)

// Shared memory of dwconv_mma_kernel<K, NT>: pitches in 16-bit elements, offsets in bytes.
template <int K, int NT>
struct MmaLayout {
  static constexpr int TW = 8 * NT;                // output columns per tile
  static constexpr int RT = kMmaRows + K - 1;      // staged rows
  static constexpr int CS = TW + K - 1;            // staged columns (at most TW + 6)
  static constexpr int NCH = NT + 1;               // 8-column chunks covering a staged row
  static constexpr int CP = 8 * (NCH % 2 ? NCH : NCH + 1);   // row pitch of an input plane
  static constexpr int ST = RT * CP + (RT * CP / 8 % 2 ? 0 : 8);  // channel pitch of the input planes
  static constexpr int TWP = 8 * (NT % 2 ? NT : NT + 1);     // row pitch of an output plane
  static constexpr int SO = kMmaRows * TWP + 8;               // channel pitch of the output planes
  static constexpr int GS = tile_smem_round(RT * CS * 16) / 2;  // one staged box of 8 channels
  static constexpr int stage_off = kTileBarBytes + tile_smem_round(kTileLanes * K * K * 4);
  static constexpr int plane_off = stage_off + 2 * 4 * GS * 2;  // two staging buffers of four boxes
  static constexpr int out_off = plane_off + tile_smem_round(kTileLanes * ST * 2);
  static constexpr int bytes = out_off + tile_smem_round(kTileLanes * SO * 2);
  // The weight gradient: staging buffers of x (four boxes with the halo) and grad_y (four of 16 x TW), the input
  // planes of x and the planes of grad_y (the output planes' layout); at the end the warps' D_i overlay them.
  static constexpr int GSG = tile_smem_round(kMmaRows * TW * 16) / 2;
  static constexpr int wg_plane_off = stage_off + 2 * 4 * (GS + GSG) * 2;
  static constexpr int wg_gplane_off = wg_plane_off + tile_smem_round(kTileLanes * ST * 2);
  static constexpr int wg_bytes = wg_gplane_off + tile_smem_round(kTileLanes * SO * 2);
  static constexpr int wg_scratch = kMmaWarps * (K * 128 + 8) * 4;  // bytes: a warp's D_i and bias sums
  static_assert(stage_off + wg_scratch <= wg_bytes, "the weight gradient's final sums fit the staging memory");
  static_assert(K % 2 == 1 && K <= 7, "the staged row must fit NT + 1 chunks of 8 columns");
  static_assert((CP / 8) % 2 == 1 && (ST / 8) % 2 == 1 && (TWP / 8) % 2 == 1 && (SO / 8) % 2 == 1,
                "pitches of an odd number of 16-byte units");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ldmatrix / stmatrix (m8n8, 16-bit): lane l gives the address of row l % 8 of matrix l / 8; register j of
// lane t holds row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1 of matrix j (.trans: rows 2 (t % 4) and
// 2 (t % 4) + 1 of column t / 4), the lower index in the lower half.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();  // sm_90 only: the host launches these kernels only where they have sm_90 code
#endif
}
__device__ __forceinline__ void stsm_x2(uint32_t addr, const uint32_t (&r)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r[0]), "r"(r[1])
               : "memory");
#else
  __trap();
#endif
}

// d += A (16 x 16, row) * B (16 x 8, col), float32 accumulators: A registers (rows g, g + 8 x columns 2q, 2q + 8
// pairs), B registers (rows 2q, 2q + 8 pairs of column g), d (row g then g + 8, columns 2q, 2q + 1), with
// g = lane / 4, q = lane % 4.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }

// Two values rounded to T, packed (lo in the lower half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return bits16(from_float<T>(lo)) | (bits16(from_float<T>(hi)) << 16);
}

// A pair of taps as B-fragment registers: rounded to T (`hi`) and the rounding's remainder (`lo`).
template <typename T>
__device__ __forceinline__ void split_taps(float v0, float v1, uint32_t& hi, uint32_t& lo) {
  const float h0 = to_float(from_float<T>(v0)), h1 = to_float(from_float<T>(v1));
  hi = pack2<T>(h0, h1);
  lo = pack2<T>(v0 - h0, v1 - h1);
}

// Thread 0 starts the copies of one tile of `rows` x `cols` pixels (top-left (w0, h0) of image b) of the CTA's 32
// channels from c0 into `dst`: four boxes of 8 channels, `box_elems` apart, counted on `bar` (with `extra` bytes
// that other boxes of the same tile add).
template <typename T>
__device__ __forceinline__ void stage_boxes(T* dst, int box_elems, const CUtensorMap* map, int c0, int w0, int h0,
                                            int b, int rows, int cols, uint64_t* bar, uint32_t extra) {
  if (threadIdx.x != 0) return;
  const uint32_t bytes = uint32_t(4 * rows * cols * 16);
  tma_begin(bar, bytes + extra);
#pragma unroll
  for (int box = 0; box < 4; ++box) tma_box(dst + box * box_elems, map, c0 + 8 * box, w0, h0, b, bar);
}

// Four staged boxes ([row][column][8 channels], `box_elems` apart) into planes [channel][row][column] (row pitch
// `rp`, channel pitch `cp`, in elements, both odd multiples of 8): per step 8 columns of one row of all 32
// channels, ldmatrix.trans then stmatrix. Columns from `cols` on (up to the next multiple of 8) become zeros.
template <typename T>
__device__ __forceinline__ void boxes_to_planes(const T* staged, int box_elems, uint32_t planes, int rows, int cols,
                                                int rp, int cp) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mat = lane / 8, mrow = lane % 8, q = lane % 4;
  const int chunks = (cols + 7) / 8;
  const uint32_t base = smem_addr(staged);
  for (int u = warp; u < rows * chunks; u += kMmaWarps) {
    const int r = u / chunks, chunk = u - r * chunks;
    const int col = min(chunk * 8 + mrow, cols - 1);
    uint32_t v[4];
    ldsm_x4_trans(v, base + 2 * (mat * box_elems + (r * cols + col) * 8));
    if (chunk * 8 + 2 * q >= cols) v[0] = v[1] = v[2] = v[3] = 0u;
    stsm_x4(planes + 2 * ((mat * 8 + mrow) * cp + r * rp + chunk * 8), v);
  }
}

struct MmaTile {
  int b, h0, w0;
};

__device__ __forceinline__ MmaTile mma_tile(int tile, const FastDiv& tiles_h, const FastDiv& tiles_w, int tw) {
  MmaTile m;
  const int rest = tiles_w.div(tile);
  const int tx = tile - rest * int(tiles_w.d);
  m.b = tiles_h.div(rest);
  m.h0 = (rest - m.b * int(tiles_h.d)) * kMmaRows;
  m.w0 = tx * tw;
  return m;
}

// y = conv(x) (+ bias) (+ x, `add_input`) (then SiLU) for 16-bit x, channels-last, C a multiple of 8; with the
// flipped taps (`flip`) the input gradient. x arrives through `tm_x` only (boxes of 8 channels x CS x RT).
template <typename T, int K, int NT>
__global__ void __launch_bounds__(kMmaThreads, 1) dwconv_mma_kernel(
    const float* __restrict__ weight, const float* __restrict__ bias, T* __restrict__ y, int H, int W, int C,
    FastDiv tiles_h, FastDiv tiles_w, int tiles, bool flip, bool add_input, bool silu_out,
    const __grid_constant__ CUtensorMap tm_x) {
  using L = MmaLayout<K, NT>;
  static_assert(L::bytes <= kMmaSmemMax, "the forward's shared memory fits an sm_90 block");
  constexpr int P = K / 2, KK = K * K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem_raw);
  float* const s_w = reinterpret_cast<float*>(smem_raw + kTileBarBytes);
  T* const s_x = reinterpret_cast<T*>(smem_raw + L::stage_off);
  const uint32_t planes = smem_addr(smem_raw + L::plane_off), outs = smem_addr(smem_raw + L::out_off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int mat = lane / 8, mrow = lane % 8;  // the ldmatrix / stmatrix row this lane addresses
  const int c0 = blockIdx.y * kTileLanes;

  stage_taps<KK>(s_w, weight, c0, C, flip);
  tma_init(bars);
  __syncthreads();

  // The warp's channels warp and warp + 16: B fragments of every kernel row, and the bias.
  uint32_t bh[2][K][2], bl[2][K][2];
  float bv[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int cl = warp + s * kMmaWarps;
    bv[s] = (bias != nullptr && c0 + cl < C) ? bias[c0 + cl] : 0.f;
#pragma unroll
    for (int i = 0; i < K; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 2 * q + e + 8 * half - g;  // B row k = 2q + e (+ 8), column n = g
          v[e] = (j >= 0 && j < K) ? s_w[cl * KK + i * K + j] : 0.f;
          if (add_input && i == P && j == P) v[e] += 1.f;
        }
        split_taps<T>(v[0], v[1], bh[s][i][half], bl[s][i][half]);
      }
    }
  }
  pipeline_tiles(
      int(blockIdx.x), tiles, int(gridDim.x), bars,
      [&](int t, int b) {
        const MmaTile m = mma_tile(t, tiles_h, tiles_w, L::TW);
        stage_boxes(s_x + b * 4 * L::GS, L::GS, &tm_x, c0, m.w0 - P, m.h0 - P, m.b, L::RT, L::CS, &bars[b], 0);
      },
      [&](int t, int b) {
        // 1. The staged boxes into the input planes; columns past the staged ones become zeros.
        boxes_to_planes(s_x + b * 4 * L::GS, L::GS, planes, L::RT, L::CS, L::CP, L::ST);
        __syncthreads();

        // 2. The products of the warp's two channels, into the output planes.
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int cl = warp + s * kMmaWarps;
          const uint32_t plane = planes + 2 * cl * L::ST;
          float acc[NT][4];
#pragma unroll
          for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = bv[s];
#pragma unroll
          for (int i = 0; i < K; ++i) {
            // Halves h = 0 .. NT: staged columns 8h .. 8h + 7 of rows i .. i + 15 (rows i .. i + 7 in a[h][0]).
            uint32_t a[NT + 2][2];
            const uint32_t row = plane + 2 * (i + (mat % 2) * 8 + mrow) * L::CP;
#pragma unroll
            for (int h = 0; h <= NT; h += 2) {
              if (h + 1 <= NT) {
                uint32_t r4[4];
                ldsm_x4(r4, row + 2 * 8 * (h + mat / 2));
                a[h][0] = r4[0], a[h][1] = r4[1], a[h + 1][0] = r4[2], a[h + 1][1] = r4[3];
              } else {
                uint32_t r2[2];
                ldsm_x2(r2, row + 2 * 8 * h);
                a[h][0] = r2[0], a[h][1] = r2[1];
              }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              const uint32_t frag[4] = {a[n][0], a[n][1], a[n + 1][0], a[n + 1][1]};
              mma_16816<T>(acc[n], frag, bh[s][i][0], bh[s][i][1]);
              mma_16816<T>(acc[n], frag, bl[s][i][0], bl[s][i][1]);
            }
          }
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = silu_out ? silu(acc[n][e]) : acc[n][e];
            const uint32_t o[2] = {pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3])};
            stsm_x2(outs + 2 * (cl * L::SO + ((mat % 2) * 8 + mrow) * L::TWP + 8 * n), o);
          }
        }
        __syncthreads();

        // 3. The output planes back to [pixel][channel]: per step 8 columns of one row of all 32 channels, each
        // lane storing two channels of one pixel per box.
        const MmaTile m = mma_tile(t, tiles_h, tiles_w, L::TW);
        for (int u = warp; u < kMmaRows * NT; u += kMmaWarps) {
          const int r = u / NT, chunk = u - r * NT;
          uint32_t v[4];
          ldsm_x4_trans(v, outs + 2 * ((mat * 8 + mrow) * L::SO + r * L::TWP + chunk * 8));
          const int h = m.h0 + r, w = m.w0 + chunk * 8 + g;
          if (h < H && w < W) {
            T* const out = y + ((int64_t(m.b) * H + h) * W + w) * C + c0 + 2 * q;
#pragma unroll
            for (int box = 0; box < 4; ++box)
              if (c0 + 8 * box + 2 * q < C) *reinterpret_cast<uint32_t*>(out + 8 * box) = v[box];
          }
        }
      });
}

// Weight and bias gradients of 16-bit x and grad_y, channels-last, C a multiple of 8: the CTA of chunk wgrad_chunk()
// sums its tiles_per_chunk consecutive tiles for its 32 channels into partial[chunk][tap][c] (tap K * K: the bias).
// x arrives through `tm_x` (boxes of 8 channels x CS x RT, with the halo), grad_y through `tm_g` (8 x TW x 16).
template <typename T, int K, int NT>
__global__ void __launch_bounds__(kMmaThreads, 1) dwconv_mma_wgrad_kernel(
    float* __restrict__ partial, int C, FastDiv tiles_h, FastDiv tiles_w, int tiles, int tiles_per_chunk,
    const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_g) {
  using L = MmaLayout<K, NT>;
  static_assert(L::wg_bytes <= kMmaSmemMax, "the weight gradient's shared memory fits an sm_90 block");
  constexpr int P = K / 2, KK = K * K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem_raw);
  T* const s_x = reinterpret_cast<T*>(smem_raw + L::stage_off);  // per buffer: 4 x boxes, then 4 grad_y boxes
  const uint32_t xplanes = smem_addr(smem_raw + L::wg_plane_off), gplanes = smem_addr(smem_raw + L::wg_gplane_off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mat = lane / 8, mrow = lane % 8;
  const int c0 = wgrad_channel_block() * kTileLanes;
  constexpr int buf_elems = 4 * (L::GS + L::GSG);

  float d[2][K][4], db[2][4];  // D_i of the warp's channels warp and warp + 16, and the bias products
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      db[s][e] = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) d[s][i][e] = 0.f;
    }
  }
  // A matrix of ones (16-bit 1.0 in both halves): its product with grad_y's block sums the block's rows.
  const uint32_t ones = bits16(from_float<T>(1.f)) * 0x10001u;
  const uint32_t ones4[4] = {ones, ones, ones, ones};

  tma_init(bars);
  __syncthreads();
  pipeline_chunk(
      tiles, tiles_per_chunk, bars,
      [&](int t, int b) {
        const MmaTile m = mma_tile(t, tiles_h, tiles_w, L::TW);
        T* const dst = s_x + b * buf_elems;
        const uint32_t g_bytes = uint32_t(4 * kMmaRows * L::TW * 16);
        stage_boxes(dst, L::GS, &tm_x, c0, m.w0 - P, m.h0 - P, m.b, L::RT, L::CS, &bars[b], g_bytes);
        if (threadIdx.x == 0) {
#pragma unroll
          for (int box = 0; box < 4; ++box)
            tma_box(dst + 4 * L::GS + box * L::GSG, &tm_g, c0 + 8 * box, m.w0, m.h0, m.b, &bars[b]);
        }
      },
      [&](int, int b) {
        const T* const src = s_x + b * buf_elems;
        boxes_to_planes(src, L::GS, xplanes, L::RT, L::CS, L::CP, L::ST);
        boxes_to_planes(src + 4 * L::GS, L::GSG, gplanes, kMmaRows, L::TW, L::TWP, L::SO);
        __syncthreads();
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int cl = warp + s * kMmaWarps;
          // B: grad_y's 16 x 8 blocks (rows r = k of the product, columns n), read transposed.
          uint32_t bq[NT][2];
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            ldsm_x2_trans(bq[n], gplanes + 2 * (cl * L::SO + ((mat % 2) * 8 + mrow) * L::TWP + 8 * n));
            mma_16816<T>(db[s], ones4, bq[n][0], bq[n][1]);
          }
#pragma unroll
          for (int i = 0; i < K; ++i) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              // A (16 staged columns k x 16 rows r): the input plane's rows i .. i + 15, columns 8n .. 8n + 15,
              // transposed; matrices (rows 0-7, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 0-7), (rows 8-15, k 8-15).
              uint32_t a[4];
              ldsm_x4_trans(a, xplanes + 2 * (cl * L::ST + (i + (mat / 2) * 8 + mrow) * L::CP + 8 * n + 8 * (mat % 2)));
              mma_16816<T>(d[s][i], a, bq[n][0], bq[n][1]);
            }
          }
        }
      });

  // The diagonal sums: tap (i, j) = sum over n of D_i[n + j][n], with D_i[k][n] in lane 4 (k % 8) + n / 2,
  // element 2 (k / 8) + n % 2; the bias: row 0 of the ones product, lanes 0-3. The staging memory is free
  // (pipeline_chunk ends at a barrier).
  float* const scratch = reinterpret_cast<float*>(smem_raw + L::stage_off) + warp * (K * 128 + 8);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int cl = warp + s * kMmaWarps;
#pragma unroll
    for (int i = 0; i < K; ++i)
      *reinterpret_cast<float4*>(scratch + i * 128 + 4 * lane) =
          make_float4(d[s][i][0], d[s][i][1], d[s][i][2], d[s][i][3]);
    if (lane < 4) {
      scratch[K * 128 + 2 * lane] = db[s][0];
      scratch[K * 128 + 2 * lane + 1] = db[s][1];
    }
    __syncwarp();
    if (c0 + cl < C) {
      for (int tap = lane; tap <= KK; tap += 32) {
        float sum = 0.f;
        if (tap < KK) {
          const int i = tap / K, j = tap - i * K;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            const int k = n + j;
            sum += scratch[i * 128 + 4 * (4 * (k % 8) + n / 2) + 2 * (k / 8) + n % 2];
          }
        } else {
#pragma unroll
          for (int n = 0; n < 8; ++n) sum += scratch[K * 128 + n];
        }
        partial[(int64_t(wgrad_chunk()) * (KK + 1) + tap) * C + c0 + cl] = sum;
      }
    }
    __syncwarp();
  }
}

template <typename T, int K, int NT>
struct MmaKernelTag {};

// Output columns per tile, in blocks of 8: the fewest of 8, 16 or 32 that cover W (or 32); the weight gradient,
// which stages two tensors, at most 16.
int mma_col_tiles(int W) { return W <= 8 ? 1 : W <= 16 ? 2 : 4; }
int mma_wgrad_col_tiles(int W) { return W <= 8 ? 1 : 2; }

// What every launch of the tensor-core kernels needs: the dtype and C, sm_90 code for this device, `bytes` of shared
// memory per block, a current context for the tensor maps. "" or the reason.
template <typename Tag, typename Kernel>
std::string mma_precheck(Kernel kernel, int C, ScalarType dtype, int bytes) {
  if (!dwconv_mma_available_for(C, dtype) || !kernel_has_tma<Tag>(kernel))
    return "gspn2: the depthwise tensor-core kernels (`kernel` 2) need float16 or bfloat16 input with C a multiple "
           "of 8 and a GPU of compute capability 9.0 with this build's sm_90 code";
  int optin = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (bytes > optin)
    return "gspn2: the depthwise tensor-core kernels need " + std::to_string(bytes) +
           " bytes of shared memory per block; this GPU allows " + std::to_string(optin);
  const cudaError_t bound = tma::bind_context();  // the tensor maps' encoder needs a current context (tma.cuh)
  if (bound != cudaSuccess) return std::string("CUDA error: ") + cudaGetErrorString(bound);
  return "";
}

template <typename T, int K, int NT>
std::string launch_mma(const DwConvForwardParams& p) {
  using L = MmaLayout<K, NT>;
  using Tag = MmaKernelTag<T, K, NT>;
  auto kernel = dwconv_mma_kernel<T, K, NT>;
  std::string err = mma_precheck<Tag>(kernel, p.C, p.dtype, L::bytes);
  if (!err.empty()) return err;
  const int tiles_h = (p.H + kMmaRows - 1) / kMmaRows, tiles_w = (p.W + L::TW - 1) / L::TW;
  const int64_t tiles = int64_t(p.B) * tiles_h * tiles_w;
  if (tiles > INT_MAX)
    return "gspn2: the depthwise tensor-core kernel indexes tiles with 32-bit integers; this input has " +
           std::to_string(tiles) + " tiles";
  CUtensorMap map{};
  err = encode_tile_box(&map, p.x, p.dtype, p.B, p.H, p.W, p.C, L::CS, L::RT, 8);
  if (!err.empty()) return err;
  allow_smem<Tag>(kernel, L::bytes);
  const int channel_blocks = (p.C + kTileLanes - 1) / kTileLanes;
  const int per_block = std::max(1, resident_ctas<Tag>(kernel, kMmaThreads, L::bytes) / channel_blocks);
  const dim3 grid(unsigned(std::min<int64_t>(tiles, per_block)), unsigned(channel_blocks));
  kernel<<<grid, kMmaThreads, L::bytes, p.stream>>>(p.weight, p.bias, static_cast<T*>(p.y), p.H, p.W, p.C,
                                                     fast_div(tiles_h), fast_div(tiles_w), int(tiles), p.flip,
                                                     p.add_input, p.silu, map);
  return "";
}

template <typename T, int K, int NT>
std::string launch_mma_wgrad(const DwConvWgradParams& p) {
  using L = MmaLayout<K, NT>;
  using Tag = MmaKernelTag<T, K, NT + 8>;
  auto kernel = dwconv_mma_wgrad_kernel<T, K, NT>;
  std::string err = mma_precheck<Tag>(kernel, p.C, p.dtype, L::wg_bytes);
  if (!err.empty()) return err;
  const MmaWgradPlan q = dwconv_mma_wgrad_plan(p.B, p.H, p.W, p.C);
  CUtensorMap map_x{}, map_g{};
  err = encode_tile_box(&map_x, p.x, p.dtype, p.B, p.H, p.W, p.C, L::CS, L::RT, 8);
  if (err.empty()) err = encode_tile_box(&map_g, p.grad_y, p.dtype, p.B, p.H, p.W, p.C, L::TW, kMmaRows, 8);
  if (!err.empty()) return err;
  allow_smem<Tag>(kernel, L::wg_bytes);
  const dim3 grid(unsigned(q.channel_blocks), unsigned(q.chunks));  // wgrad_channel_block(), wgrad_chunk()
  kernel<<<grid, kMmaThreads, L::wg_bytes, p.stream>>>(p.partial, p.C, fast_div(q.tiles_h), fast_div(q.tiles_w),
                                                        int(q.tiles), int(q.tiles_per_chunk), map_x, map_g);
  launch_chunk_reduce(p.partial, p.grad_w, p.grad_b, q.chunks, p.C, p.K * p.K, p.stream);
  return "";
}

// Per kernel size and columns per tile, for both directions (Launch<T, K, NT>::run(p)).
template <typename T, int K, template <typename, int, int> class Launch, typename Params>
std::string dispatch_mma_cols(const Params& p) {
  switch (Launch<T, K, 1>::col_tiles(p.W)) {
    case 1: return Launch<T, K, 1>::run(p);
    case 2: return Launch<T, K, 2>::run(p);
    default: return Launch<T, K, 4>::run(p);
  }
}

template <typename T, template <typename, int, int> class Launch, typename Params>
std::string dispatch_mma(const Params& p) {
  switch (p.K) {
    case 3: return dispatch_mma_cols<T, 3, Launch>(p);
    case 5: return dispatch_mma_cols<T, 5, Launch>(p);
    case 7: return dispatch_mma_cols<T, 7, Launch>(p);
    default: return "gspn2: the depthwise tensor-core kernels take K in {3, 5, 7}, got " + std::to_string(p.K);
  }
}

template <typename T, int K, int NT>
struct MmaForward {
  static int col_tiles(int W) { return mma_col_tiles(W); }
  static std::string run(const DwConvForwardParams& p) { return launch_mma<T, K, NT>(p); }
};
template <typename T, int K, int NT>
struct MmaWgrad {
  static int col_tiles(int W) { return mma_wgrad_col_tiles(W); }
  static std::string run(const DwConvWgradParams& p) {
    if constexpr (NT <= 2) {
      return launch_mma_wgrad<T, K, NT>(p);
    } else {
      return "gspn2: no weight-gradient tensor-core kernel with " + std::to_string(8 * NT) + " columns per tile";
    }
  }
};

template <template <typename, int, int> class Launch, typename Params>
std::string dispatch_mma_dtype(const Params& p) {
  std::string error;
  switch (p.dtype) {
    case ScalarType::Half: error = dispatch_mma<__half, Launch>(p); break;
    case ScalarType::BFloat16: error = dispatch_mma<__nv_bfloat16, Launch>(p); break;
    default: return "gspn2: the depthwise tensor-core kernels (`kernel` 2) take float16 or bfloat16 input";
  }
  return error.empty() ? last_launch_error() : error;
}

}  // namespace

bool dwconv_mma_available_for(int C, ScalarType dtype) {
  return dtype != ScalarType::Float && C % 8 == 0;
}

std::string dwconv_mma_forward_launch(const DwConvForwardParams& p) { return dispatch_mma_dtype<MmaForward>(p); }

MmaWgradPlan dwconv_mma_wgrad_plan(int B, int H, int W, int C) {
  MmaWgradPlan q;
  const int tw = 8 * mma_wgrad_col_tiles(W);
  q.tiles_h = (H + kMmaRows - 1) / kMmaRows;
  q.tiles_w = (W + tw - 1) / tw;
  q.tiles = int64_t(B) * q.tiles_h * q.tiles_w;
  q.channel_blocks = (C + kTileLanes - 1) / kTileLanes;
  split_tiles(q.tiles, kMmaWgradCtas, q.channel_blocks, &q.tiles_per_chunk, &q.chunks);
  return q;
}

std::string dwconv_mma_wgrad_launch(const DwConvWgradParams& p) {
  if (dwconv_mma_wgrad_plan(p.B, p.H, p.W, p.C).tiles > INT_MAX)
    return "gspn2: the depthwise tensor-core kernel indexes tiles with 32-bit integers; this input has more";
  return dispatch_mma_dtype<MmaWgrad>(p);
}

}  // namespace gspn2
