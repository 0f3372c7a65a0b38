"""The replay state a checkpoint carries, and where it lives.

A run's replay state (:class:`ReplayState`) is everything that decides its
future replay stream: the sampler's ``state_dict()``, the planner's RNG, the
store's row count when it was taken, and the :class:`~.planners.Timeline` of
rows excluded from replay. It is saved

- in the replay store itself, as the state ``"trl.replay"`` (the newest one;
  offline readers find the excluded ranges there), and
- in every checkpoint folder TRL writes, in a small state-only store
  ``diskreplay_replay`` (``diskreplay_replay.rank-<i>`` for process ``i`` of a
  multi-process run), written *before* TRL's own files, so a checkpoint folder
  that TRL finished always has its replay state.

Both go through :meth:`~diskreplay.ReplayStore.save_state`, which writes JSON
and Arrow durably: nothing is pickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from ... import FormatError, ReplayStore
from .planners import REPLAY_MODES, Timeline

__all__ = ["CHECKPOINT_DIR", "STATE_NAME", "STREAM_STATE_NAME", "ReplayState", "checkpoint_state_path",
           "load_checkpoint_state", "load_checkpoint_stream", "save_checkpoint_state"]

STATE_NAME = "trl.replay"
#: the rollout stream's cursor a checkpoint of a ``replay_stream`` run carries
STREAM_STATE_NAME = "trl.stream"
STATE_FORMAT = "diskreplay.trl_replay"
STATE_VERSION = 2
CHECKPOINT_DIR = "diskreplay_replay"


def _rng_state(rng: np.random.Generator) -> Dict[str, Any]:
    st = rng.bit_generator.state
    return {"state": {"state": int(st["state"]["state"]), "inc": int(st["state"]["inc"])},
            "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])}


def _rng_from(state: Dict[str, Any]) -> np.random.Generator:
    bitgen = np.random.PCG64()
    bitgen.state = {"bit_generator": "PCG64",
                    "state": {"state": int(state["state"]["state"]), "inc": int(state["state"]["inc"])},
                    "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}
    return np.random.Generator(bitgen)


@dataclass
class ReplayState:
    """The replay state of a run at one point (see the module docstring).

    ``next_row``: the store's ``next_row`` when the state was taken (rows at or
    above it were committed later). ``sampler``: the sampler's
    ``state_dict()`` or None (mode ``off``).

    >>> rng = np.random.Generator(np.random.PCG64(0))
    >>> s = ReplayState("ssr", None, rng, next_row=16, global_step=2, store_path="/x",
    ...                 timeline=Timeline(((16, 32),)))
    >>> t = ReplayState.from_dict(s.to_dict())
    >>> t.next_row, t.timeline.excluded, t.rng.random() == s.rng.random()
    (16, ((16, 32),), True)
    """

    replay_mode: str
    sampler: Optional[Dict[str, Any]]
    rng: np.random.Generator
    next_row: int = 0
    global_step: int = 0
    store_path: str = ""
    timeline: Timeline = field(default_factory=Timeline)

    def to_dict(self) -> Dict[str, Any]:
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "replay_mode": self.replay_mode,
                "sampler": self.sampler, "rng": _rng_state(self.rng), "next_row": int(self.next_row),
                "global_step": int(self.global_step), "store_path": self.store_path,
                "excluded": self.timeline.to_list()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "the replay state") -> "ReplayState":
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT or d.get("version") not in (1, STATE_VERSION):
            got = (d.get("format"), d.get("version")) if isinstance(d, dict) else type(d).__name__
            raise FormatError(f"Unsupported replay state {got!r} in {where}; expected format={STATE_FORMAT!r} "
                              f"version={STATE_VERSION}")
        try:
            mode = d["replay_mode"]
            if mode not in REPLAY_MODES:
                raise FormatError(f"replay_mode {mode!r}")
            # version 1 (before timelines) recorded no row count and no exclusions
            return cls(mode, d.get("sampler"), _rng_from(d["rng"]), int(d.get("next_row", 0)),
                       int(d.get("global_step", 0)), str(d.get("store_path", "")),
                       Timeline.from_list(d.get("excluded")))
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"Unsupported replay state in {where}: {exc}; expected a dict saved by "
                              "DiskReplayGRPOTrainer") from None


def checkpoint_state_path(folder: str, process_index: int = 0, num_processes: int = 1) -> str:
    """Where a checkpoint folder keeps this process's replay state.

    >>> checkpoint_state_path("out/checkpoint-2"), checkpoint_state_path("c", 1, 2)
    ('out/checkpoint-2/diskreplay_replay', 'c/diskreplay_replay.rank-00001')
    """
    name = CHECKPOINT_DIR if num_processes == 1 else f"{CHECKPOINT_DIR}.rank-{process_index:05d}"
    return os.path.join(folder, name)


def save_checkpoint_state(path: str, state: ReplayState, stream: Optional[Dict[str, Any]] = None) -> None:
    """Durably write ``state`` (and a rollout stream's ``state_dict()``) into a state-only store at
    ``path`` (created if missing).

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> state = ReplayState("off", None, np.random.Generator(np.random.PCG64(0)), next_row=8)
    >>> save_checkpoint_state(os.path.join(tmp.name, CHECKPOINT_DIR), state)
    >>> load_checkpoint_state(os.path.join(tmp.name, CHECKPOINT_DIR)).next_row
    8
    >>> tmp.cleanup()
    """
    with ReplayStore(path, group_key=None) as holder:
        if stream is not None:  # first: a folder with the replay state has the stream's too
            holder.save_state(STREAM_STATE_NAME, stream)
        holder.save_state(STATE_NAME, state.to_dict())


def load_checkpoint_stream(path: str) -> Optional[Dict[str, Any]]:
    """The rollout stream's cursor :func:`save_checkpoint_state` wrote at ``path``, or None."""
    try:
        holder = ReplayStore(path, readonly=True)
    except FileNotFoundError:
        return None
    with holder:
        return holder.load_state(STREAM_STATE_NAME)


def load_checkpoint_state(path: str) -> Optional[ReplayState]:
    """The state :func:`save_checkpoint_state` wrote at ``path``, or None if there is none."""
    try:
        holder = ReplayStore(path, readonly=True)
    except FileNotFoundError:
        return None
    with holder:
        raw = holder.load_state(STATE_NAME)
    return None if raw is None else ReplayState.from_dict(raw, path)
