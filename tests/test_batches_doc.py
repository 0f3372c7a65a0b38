"""docs/batches.md's sampler table shows calls a user can copy: each one constructs."""

from __future__ import annotations

import re
from pathlib import Path

import diskreplay

DOC = (Path(__file__).resolve().parent.parent / "docs" / "batches.md").read_text()

# a value for every keyword the table names without one
_VALUES = {"num_groups": 2, "samples_per_group": 4, "strategy": "variance", "alpha": 0.6, "eps": 1e-6}


def _sampler_table_calls():
    table = DOC.split("## Sampling", 1)[1].split("\n\n", 2)[1]
    first_cells = [line.split(" | ")[0] for line in table.splitlines()[2:]]
    return [call for cell in first_cells for call in re.findall(r"`(\w+\([^`]*\))`", cell)]


def test_every_sampler_call_in_the_table_constructs():
    """The table showed ``PromptGroupSampler(num_groups=, samples_per_group=, strategy=)``: giving both
    raises SamplerError ("give exactly one of num_groups / samples_per_group")."""
    calls = _sampler_table_calls()
    assert {call.split("(")[0] for call in calls} == {"PromptGroupSampler", "RandomSampler", "PrioritizedSampler"}
    for call in calls:
        name, args = re.fullmatch(r"(\w+)\((.*)\)", call).groups()
        keywords = [arg.strip().rstrip("=") for arg in args.split(",") if arg.strip()]
        getattr(diskreplay, name)(**{key: _VALUES[key] for key in keywords})
