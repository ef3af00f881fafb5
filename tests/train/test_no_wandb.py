"""train.py with logger=none runs where wandb cannot be imported; an enabled logger there is a config error."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.train._helpers import REPO, TINY

# A child process in which `import wandb` raises ImportError (a finder ahead of every other one), as on a
# machine without the package. It trains once with each set of overrides in argv[1:] (sets separated by
# "--"; one process for all, as its start-up is most of the test's time) and prints, for each, the run
# directory or the ConfigError's message.
WITHOUT_WANDB = """
import sys

class NoWandb:
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoWandb())
from gspn2.train.config import ConfigError
from tests.train._helpers import compose_cfg, load_script
train = load_script("train").train
runs = [[]]
for arg in sys.argv[1:]:
    if arg == "--":
        runs.append([])
    else:
        runs[-1].append(arg)
for overrides in runs:
    try:
        run_dir = train(compose_cfg(overrides))
    except ConfigError as e:
        print(f"ConfigError: {e}")
    else:
        assert "wandb" not in sys.modules
        print(f"trained: {run_dir}")
"""


def _run_without_wandb(*overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", WITHOUT_WANDB, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_logger_none_trains_without_wandb_and_an_enabled_logger_is_refused(digits_root, tmp_path):
    common = [
        *[o for o in TINY if not o.startswith("logger.")],
        f"data.root={digits_root}",
        "trainer.epochs=1",
        "trainer.limit_train_steps=2",
    ]
    run_dir, refused = tmp_path / "none", tmp_path / "offline"
    proc = _run_without_wandb(
        *common, "logger=none", f"run_dir={run_dir}", "--", *common, "logger=wandb", f"run_dir={refused}"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"trained: {run_dir}\n") == 1, proc.stdout[-3000:]
    trained, refusal = proc.stdout.split(f"trained: {run_dir}\n")  # the first run's output, the second's
    assert (run_dir / "last.pt").is_file() and not (run_dir / "wandb").exists()
    assert "wandb: disabled" in trained

    assert "ConfigError: logger.mode=offline needs the wandb package" in refusal
    assert "logger=none" in refusal
    assert not refused.exists()  # refused before anything was written
