"""The Slurm launcher's batch script (launch/slurm.py) holds each config value as one quoted word: a value with
quotes, ``$()``, backticks or a backslash reaches sbatch and bash as itself and runs nothing, and a value with a line
break is refused at launch, before anything is written or submitted, with one line naming its key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.launch.slurm import batch_script, check_launch
from tests.conftest import REPO, needs_extra

HOSTILE = "it's \"$(touch pwned-1)\" `touch pwned-2` $HOME \\ # ; & x"
"""Every character bash or sbatch reads as syntax in a value, but no line break."""

SLURM = {"launcher": {"kind": "slurm", "dry_run": True}}  # dry run: no sbatch needed here


def cfg_of(*nested: dict):
    return load_config(OmegaConf.merge(OmegaConf.create({"run": {"id": "readme"}}), SLURM, *nested))


@pytest.mark.parametrize("key,nested", [
    ("run.id", {"run": {"id": "r1\ntouch pwned"}}),
    ("run.dir", {"run": {"dir": "/runs/r1\ntouch pwned"}}),
    ("launcher.job_name", {"launcher": {"job_name": "rl\ntouch pwned"}}),
    ("launcher.partition", {"launcher": {"partition": "gpu\rtouch pwned"}}),
    ("launcher.account", {"launcher": {"account": "rl\x00"}}),
    ("launcher.trainer.partition", {"launcher": {"trainer": {"partition": "gpu\ntouch pwned"}}}),
    ("launcher.rollout.sbatch[1]", {"launcher": {"rollout": {"sbatch": ["--exclusive", "--comment=x\ntouch pwned"]}}}),
    ("launcher.setup[0]", {"launcher": {"setup": ["module load cuda\ntouch pwned"]}}),
])
def test_a_line_break_in_a_value_of_the_batch_script_is_refused_at_launch_naming_its_key(key, nested):
    with pytest.raises(ConfigError) as refused:
        check_launch(cfg_of(nested))
    message = str(refused.value)
    assert message.startswith(f"{key}=") and "control character" in message, message
    assert "\n" not in message and "\r" not in message, "one line"


def test_launch_refuses_a_run_id_with_a_line_break_before_writing_anything(tmp_path):
    """The issue's case: ``launch.py launcher=slurm launcher.dry_run=true`` with a run id whose second line is a
    command exits 2 with one line naming run.id; no script is printed, no run directory made."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(REPO / "launch.py"), "launcher=slurm", "launcher.dry_run=true",
                           f"run.dir={run_dir}", "run.id='r1\ntouch pwned'"], check=False, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: run.id='r1\\ntouch pwned' holds a line break") and done.stderr.count(
        "\n") == 1, done.stderr
    assert done.stdout == "" and not run_dir.exists() and not (tmp_path / "pwned").exists()


def test_a_line_break_in_hydras_run_directory_is_refused_too():
    with pytest.raises(ConfigError, match=r"^run.dir='/outputs/x\\ntouch pwned' holds a line break"):
        check_launch(cfg_of(), Path("/outputs/x\ntouch pwned"))


def sbatch_words(line: str) -> list[str]:
    """The arguments sbatch takes from an #SBATCH line (after the magic word), as Slurm's src/sbatch/opt.c
    (``_get_argument``) reads it: words split at unquoted white space, single and double quotes, a backslash
    escaping the next character (inside quotes too), an unquoted ``#`` ending the line."""
    words, i = [], 0
    while True:
        while i < len(line) and line[i].isspace():
            i += 1
        if i == len(line) or line[i] == "#":
            return words
        word, quote, escape = "", None, False
        while i < len(line) and (quote or not line[i].isspace()):
            c, i = line[i], i + 1
            if escape:
                word, escape = word + c, False
            elif c == "\\":
                escape = True
            elif quote:
                word, quote = (word, None) if c == quote else (word + c, quote)
            elif c in "'\"":
                quote = c
            elif c == "#":
                i -= 1
                break
            else:
                word += c
        assert quote is None, f"sbatch stops at an unmatched {quote} in {line!r}"
        words.append(word)


def bash_words(text: str, cwd: Path) -> list[str]:
    """The words bash makes of ``text`` as arguments of a command."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], check=False, cwd=cwd, capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().split("\0")[:-1]


def test_values_with_quotes_substitutions_and_backslashes_are_one_word_to_sbatch_and_bash(tmp_path):
    """Hostile run id, job name, partition, account, extra #SBATCH option, run directory and Python path: the
    script has the lines of a plain one, bash -n takes it, every #SBATCH line is the one option it was meant to be
    to both sbatch and bash, and bash running the script hands srun the Python path and the task folder as single
    words; no command in them runs."""
    def values(value: str) -> dict:
        trainer = {"partition": value + "'", "sbatch": [f"--comment={value}"]}
        return {"run": {"id": value}, "launcher": {"job_name": value, "partition": value, "account": value,
                                                   "trainer": trainer}}

    cfg = cfg_of(values(HOSTILE))
    check_launch(cfg)  # refused: only control characters
    bin_dir = tmp_path / HOSTILE
    bin_dir.mkdir()
    python, folder = bin_dir / "python", str(tmp_path / HOSTILE / "slurm")
    python.write_text('#!/bin/sh\nprintf \'%s\\0\' "$@" > "$ARGV_FILE"\n')  # stands in for python and records argv
    python.chmod(0o755)
    script = batch_script(cfg, folder=Path(folder), python=str(python))
    plain = batch_script(cfg_of(values("x")), folder=Path("/r/slurm"), python="python")
    assert len(script.splitlines()) == len(plain.splitlines()), "no value started a line of its own"
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True).returncode == 0

    options = []
    for line in script.splitlines():
        if line.startswith("#SBATCH ") and line != "#SBATCH hetjob":
            rest = line.removeprefix("#SBATCH ")
            words = sbatch_words(rest)
            assert len(words) == 1 and bash_words(rest, tmp_path) == words, line
            options += words
    for option in (f"--job-name={HOSTILE}", f"--partition={HOSTILE}", f"--account={HOSTILE}",
                   f"--partition={HOSTILE}'", f"--comment={HOSTILE}", f"--output={folder}/%j_batch.out"):
        assert option in options, (option, options)

    argv_file = tmp_path / "argv"
    ran = subprocess.run(["bash", str(path)], check=False, cwd=tmp_path, capture_output=True, timeout=30,
                         env={**os.environ, "ARGV_FILE": str(argv_file)})
    assert ran.returncode == 0, ran.stderr.decode()
    task = [str(python), "-u", "-m", "rolloutpipe.launch.slurm", folder]
    assert argv_file.read_bytes().decode().split("\0")[:-1] == [
        "-m", "rolloutpipe.launch.requeue", "--", "srun", "--unbuffered", "--kill-on-bad-exit=0",
        "--het-group=0", *task, ":", "--het-group=1", *task]
    assert not list(tmp_path.glob("pwned*")), "a command in a value ran"


@needs_extra("slurm", "torchx")
@pytest.mark.parametrize("override,key", [("run.id='r1,LD_PRELOAD=/tmp/x.so'", "run.id"),
                                          ("run.dir='/runs/a,b'", "run.dir"), ("run.id='r1\ntouch pwned'", "run.id")])
def test_torchx_refuses_a_value_that_would_start_another_variable_of_its_srun_export(tmp_path, monkeypatch, override,
                                                                                     key):
    """TorchX's Slurm scheduler writes each role's env as ``srun --export=ALL,KEY=VALUE,...`` into its batch script:
    the component refuses a run id or directory with a comma (another variable, LD_PRELOAD say) or a line break,
    before it writes anything."""
    from launchers.components import _prepare

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^{key}=.* holds a comma or a control character"):
        _prepare([override])
    assert not list(tmp_path.rglob("config.yaml"))
