"""``python tools/X.py --help`` explains every option of each tool script, with its default, and says
how to run the script; a value that must be positive is refused as a usage error (exit status 2)
before any work. (tools/bench.py has its own tests.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parent.parent

# script: one value that must be refused (a count or a duration that must be positive, or a negative one)
TOOLS = {
    "faults": ["--jobs", "0"],
    "soak": ["--minutes", "0"],
    "train_grpo_replay": ["--steps", "0"],
    "async_grpo": ["--batch-groups", "0"],
    "ray_rollouts": ["--num-cpus", "0"],
    "gpu_check": ["--step-ms", "-5"],
    "s3_clients": ["--rounds", "0"],
}


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(ROOT / "tools" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


def option_help(text: str) -> Dict[str, str]:
    """Each option of an argparse help text (its first long name) and the help after it.

    An entry starts with two spaces and a dash; its help follows after two or more spaces on the same
    line, or on the more deeply indented lines below it.

    >>> option_help("usage: x\\n\\noptions:\\n  -h, --help  show this\\n  --rounds N\\n          rounds, medians\\n"
    ...             "  --keep\\n\\nepilog")
    {'--help': 'show this', '--rounds': 'rounds, medians', '--keep': ''}
    """
    section = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    found: Dict[str, str] = {}
    current = None
    for line in section.splitlines():
        entry = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if entry:
            names = re.findall(r"(?:^|, )(--?[\w-]+)", entry.group(1))
            current = next((n for n in names if n.startswith("--")), names[0])
            found[current] = (entry.group(2) or "").strip()
        elif current is not None and line.startswith("   "):
            found[current] = (found[current] + " " + line.strip()).strip()
    return found


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_help_explains_every_option_with_its_default(name):
    p = _run(name, "--help")
    assert p.returncode == 0, p.stderr[-3000:]
    helps = option_help(p.stdout)
    usage = p.stdout.split("\n\n", 1)[0]
    in_usage = set(re.findall(r"\[?(--[\w-]+)", usage))
    assert in_usage and in_usage <= set(helps), (in_usage - set(helps), p.stdout)
    unexplained = [opt for opt, text in helps.items() if not text]
    assert not unexplained, f"tools/{name}.py --help: no help for {unexplained}\n{p.stdout}"
    # an option that takes a value says what it is when not given
    takes_value = set(re.findall(r"^  (--[\w-]+) [A-Z{]", p.stdout.split("\noptions:\n", 1)[1], flags=re.M))
    undefaulted = [opt for opt in sorted(takes_value) if not re.search(r"default|required", helps[opt])]
    assert not undefaulted, f"tools/{name}.py --help: no default said for {undefaulted}\n{p.stdout}"
    assert f"python tools/{name}.py" in p.stdout, f"tools/{name}.py --help does not say how to run it"


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_a_value_that_must_be_positive_is_a_usage_error(name):
    option, value = TOOLS[name]
    p = _run(name, option, value)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert option in p.stderr and value in p.stderr and "must be" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
