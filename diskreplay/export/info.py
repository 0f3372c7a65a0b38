"""A summary of a store: size, layout, columns (with their patches and named versions), token counts, reward
statistics."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import format as fmt
from ..schema import RAGGED
from ..storage import is_remote
from ._common import CHUNK_BYTES, Exclusions, StoreLike, open_store, per_row_value, plan_chunks, tree_size
from .outputs import progress_bar

_STAT_HINTS = ("reward", "advantage")


class RunningStats:
    """Count, mean, std, min and max merged chunk by chunk (Chan et al.'s parallel update).

    >>> s = RunningStats(); s.add(np.array([1.0, 2.0])); s.add(np.array([3.0, 4.0]))
    >>> s.summary()
    {'count': 4, 'mean': 2.5, 'std': 1.118033988749895, 'min': 1.0, 'max': 4.0}
    """

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0  # of the finite values
        self.lo, self.hi = math.inf, -math.inf
        self.infs = [0, 0]  # -inf, +inf: the mean is theirs (NaN with both), the std undefined

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        x = x[~np.isnan(x)]
        finite = np.isfinite(x)
        if not finite.all():
            self.infs[0] += int((x == -math.inf).sum())
            self.infs[1] += int((x == math.inf).sum())
            self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
            x = x[finite]
        if not x.size:
            return
        n, mean = x.size, float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def summary(self) -> Optional[Dict[str, Any]]:
        """``None`` before any value that is not NaN; NaNs are not counted.

        >>> s = RunningStats(); s.add(np.array([1.0, -np.inf, np.nan])); s.summary()
        {'count': 2, 'mean': -inf, 'std': nan, 'min': -inf, 'max': 1.0}
        """
        neg, pos = self.infs
        count = self.n + neg + pos
        if not count:
            return None
        if neg or pos:
            mean = math.nan if neg and pos else (math.inf if pos else -math.inf)
            return {"count": count, "mean": mean, "std": math.nan, "min": self.lo, "max": self.hi}
        return {"count": self.n, "mean": self.mean, "std": math.sqrt(self.m2 / self.n), "min": self.lo,
                "max": self.hi}


def _retain_seconds(st: Any) -> Optional[int]:
    """The retention in force: the stored option, else the multi-writer default (None: none)."""
    if st.options.retain_seconds is not None:
        return st.options.retain_seconds
    return fmt.DEFAULT_RETAIN_SECONDS if st.multi_writer else None


def commit_stats(manifest: fmt.Manifest) -> Optional[Dict[str, Any]]:
    """The commit counters a multi-writer store keeps in its manifests (summed over every writer),
    with the retry time share; None where the store does not record them (single-writer stores).

    >>> m = fmt.Manifest(commit_stats={"commits": 10, "conflicts": 2, "commit_ms": 50, "retry_ms": 5})
    >>> s = commit_stats(m); s["commits"], s["retries"], s["conflicts_per_commit"], s["retry_share"]
    (10, 2, 0.2, 0.1)
    """
    c = manifest.commit_stats
    if not c:
        return None
    commits, conflicts, total, retry = (c.get(k, 0) for k in fmt.COMMIT_STATS)
    return {"commits": commits, "conflicts": conflicts, "retries": conflicts,  # every lost race is retried
            "conflicts_per_commit": conflicts / commits if commits else 0.0,
            "commit_ms": total, "retry_ms": retry, "retry_share": retry / total if total else 0.0}


def _kept(lo: int, hi: int, ranges: Sequence[Tuple[int, int]]) -> Iterator[Tuple[int, int]]:
    """The runs of ``[lo, hi)`` outside the sorted, disjoint ``ranges``.

    >>> list(_kept(0, 10, [(2, 4), (8, 12)]))
    [(0, 2), (4, 8)]
    """
    for a, b in ranges:
        if b <= lo or a >= hi:
            continue
        if a > lo:
            yield lo, a
        lo = max(lo, b)
    if lo < hi:
        yield lo, hi


def store_info(store: StoreLike, *, progress: bool = False, version_key: str = "policy_version",
               include_excluded: bool = False) -> Dict[str, Any]:
    """Rows, groups, segments, bytes, token counts, columns and reward/advantage statistics.

    Statistics cover every numeric per-row column whose name contains
    ``reward`` or ``advantage`` (a vector column per component and averaged),
    over the live rows, streamed chunk by chunk; the policy-version range comes
    from ``version_key``. Rows the store records as excluded (a resumed TRL
    run's discarded timeline: ``excluded`` gives their live ranges and count)
    are left out of the token counts, statistics and version range unless
    ``include_excluded``, as exports leave them out. Each column says how
    many ``patches`` hold values of it that no merge or ``compact`` has folded
    yet, and its named ``versions`` (``ReplayStore.versions``).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> with ReplayStore(tempfile.mkdtemp()) as s:
    ...     _ = s.extend({"prompt_id": [0, 0], "completion_ids": [[1, 2, 3], [4]], "rewards": [1.0, 0.0],
    ...                   "policy_version": [3, 4]})
    ...     info = store_info(s)
    >>> info["rows"], info["groups"], info["tokens"]["completion"], info["stats"]["rewards"]["mean"]
    (2, 1, 4, 0.5)
    >>> info["policy_version"]
    {'min': 3, 'max': 4}
    """
    with open_store(store) as st:
        schema = st.schema
        segments = [s for s in st.manifest.segments if s.end_row > st.head]
        columns: List[Dict[str, Any]] = [] if schema is None else [c.to_dict() for c in schema.columns.values()]
        patches = st.manifest.patches
        for c in columns:
            since = None if schema is None else schema.late.get(c["name"])
            if since is not None:  # added after the first commit: older rows have no value
                c["since_row"] = since[0]
            # values written for committed rows: until a merge or compact folds them, each read overlays them
            c["patches"] = sum(1 for p in patches if c["name"] in p.columns and not p.folded)
            c["versions"] = st.versions(c["name"])
        info: Dict[str, Any] = {
            "path": st.path, "rows": len(st), "head": st.head, "next_row": st.next_row,
            "generation": st.generation, "group_key": st.group_key,
            "groups": st.num_groups if st.group_key is not None and len(st) else (0 if st.group_key else None),
            "segments": len(segments), "bytes": int(st.nbytes), "capacity": st.capacity,
            "capacity_bytes": st.capacity_bytes, "columns": columns,
            "multi_writer": st.multi_writer, "retain_seconds": _retain_seconds(st),
            "commit_stats": commit_stats(st.manifest),
            # media blobs live rows name, each content once (docs/media.md)
            "media": ({"blobs": len(st.manifest.media), "bytes": sum(e.bytes for e in st.manifest.media)}
                      if st.manifest.media else None),
            # every file (retained commits' files, merge inputs, commits in flight), not the live rows' only
            "disk_bytes": tree_size(st.path) if st.storage.can_map else None,
        }
        excluded = Exclusions.of(st, include_excluded)
        info["excluded"] = ({k: v for k, v in excluded.report().items() if k != "left_out"}
                            if excluded.ranges else None)
        skip = () if include_excluded else excluded.ranges
        names = [] if schema is None else schema.names
        # a store written before imports checked token ids may hold them as another kind
        token_cols = [c for c in ("prompt_ids", "completion_ids") if c in names and schema[c].kind == RAGGED]
        stat_cols = [c for c in names if schema[c].kind != RAGGED and schema[c].dtype not in ("string", "bool")
                     and any(h in c.lower() for h in _STAT_HINTS)]
        version = version_key if version_key in names and schema[version_key].kind == "scalar" \
            and schema[version_key].dtype not in ("string", "bool") else None
        tokens = {c: 0 for c in token_cols}
        stats = {c: RunningStats() for c in stat_cols}
        parts: Dict[str, List[RunningStats]] = {c: [RunningStats() for _ in range(schema[c].width)]
                                                for c in stat_cols if schema[c].kind == "vector"}
        vmin, vmax = math.inf, -math.inf
        read = token_cols + stat_cols + ([version] if version and version not in stat_cols else [])
        if read and len(st):
            with progress_bar(len(st), "info", progress) as bar:
                for lo, hi in (run for chunk in plan_chunks(st, CHUNK_BYTES) for piece in chunk
                               for run in _kept(piece[0], piece[1], skip)):
                    data = st.read(np.arange(lo, hi), read)
                    for c in token_cols:
                        col = data[c]
                        if col is not None:
                            lengths = np.diff(col.offsets)
                            if col.validity is not None:
                                lengths = lengths[col.validity]
                            tokens[c] += int(lengths.sum())
                    for c in stat_cols:
                        v = np.asarray(data[c], dtype=np.float64)
                        if v.ndim == 2:
                            for j, p in enumerate(parts[c]):
                                p.add(v[:, j])
                            with np.errstate(invalid="ignore"):  # inf and -inf in one row: NaN
                                v = per_row_value(v)
                        stats[c].add(v)
                    if version:
                        v = np.asarray(data[version])
                        vmin, vmax = min(vmin, v.min()), max(vmax, v.max())
                    bar.update(hi - lo)  # (an excluded run is not read: the bar may end short of the rows)
        info["tokens"] = {c.split("_")[0]: n for c, n in tokens.items()}
        comp = tokens.get("completion_ids", 0)
        info["bytes_per_completion_token"] = (info["bytes"] / comp) if comp else None
        info["stats"] = {}
        for c in stat_cols:
            s = stats[c].summary()
            if s is not None and c in parts:
                s["per_component"] = [p.summary() for p in parts[c]]
            info["stats"][c] = s
        info["policy_version"] = ({"min": int(vmin), "max": int(vmax)} if version and vmin <= vmax else None)
    return info


def format_info(info: Dict[str, Any]) -> str:
    """``store_info``'s dict as aligned human-readable text."""
    def size(n: Optional[float]) -> str:
        if n is None:
            return "-"
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or unit == "TiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
        return str(n)

    lines = [f"store       {info['path']}",
             f"rows        {info['rows']:,} live "
             + (f"(ids {info['head']:,}..{info['next_row'] - 1:,})" if info['rows'] else "(none yet)")
             + f", generation {info['generation']}",
             f"groups      {info['groups'] if info['groups'] is not None else '-'}"
             f" (key: {info['group_key'] or 'none'})",
             f"segments    {info['segments']}",
             f"on disk     {size(info['bytes'])} live"
             + (f", {size(info['disk_bytes'])} in all (with what retained commits, pinned readers and "
                "commits in flight still need)" if info.get("disk_bytes") is not None else "")
             + (f", {info['bytes_per_completion_token']:.2f} bytes per completion token"
                if info.get("bytes_per_completion_token") else ""),
             f"capacity    {info['capacity'] if info['capacity'] is not None else 'unbounded'} rows"
             + (f", {size(info['capacity_bytes'])}" if info.get("capacity_bytes") else "")]
    if "multi_writer" in info:
        retain = info.get("retain_seconds")
        one = "one (object storage has no lock: a second writer's commit is refused)" \
            if is_remote(str(info["path"])) else "one (exclusive lock)"
        lines.append("writers     " + ("many (multi_writer)" if info["multi_writer"] else one)
                     + (f", files of superseded commits kept {retain} s" if retain else ""))
    cs = info.get("commit_stats")
    if cs:
        lines.append(f"commits     {cs['commits']:,} ({cs['conflicts']:,} lost races, each retried: "
                     f"{cs['conflicts_per_commit']:.2f} per commit; retries {cs['retry_share']:.1%} of "
                     f"{cs['commit_ms'] / 1e3:.1f} s commit time)")
    ex = info.get("excluded")
    if ex:
        ranges = ", ".join(f"[{a:,}, {b:,})" for a, b in ex["ranges"][:8]) + (", ..." if len(ex["ranges"]) > 8 else "")
        lines.append(f"excluded    {ex['rows']:,} rows {ranges}: a resumed run's discarded timeline (recorded in "
                     "the 'trl.replay' state); "
                     + ("counted below (--include-excluded)" if ex["included"] else
                        "left out below and by export, pairs and best-of-n (--include-excluded to use them)"))
    if info.get("media"):
        lines.append(f"media       {info['media']['blobs']:,} blobs, {info['media']['bytes']:,} bytes (each content once)")
    if info.get("tokens"):
        lines.append("tokens      " + ", ".join(f"{k} {v:,}" for k, v in info["tokens"].items()))
    if info.get("policy_version"):
        pv = info["policy_version"]
        lines.append(f"policy      versions {pv['min']}..{pv['max']}")
    if info["columns"]:
        lines.append("columns")
        w = max(len(c["name"]) for c in info["columns"])
        for c in info["columns"]:
            extra = " (media: content hashes)" if c.get("media") else f"[{c['width']}]" if c.get("width") else ""
            align = f"  aligned with {c['align']}" if c.get("align") else ""
            late = f"  from row {c['since_row']}" if c.get("since_row") is not None else ""
            patched = (f"  {c['patches']} patch{'' if c['patches'] == 1 else 'es'} not yet folded (compact folds "
                       "them)" if c.get("patches") else "")
            lines.append(f"  {c['name']:<{w}}  {c['kind']:<6}  {c['dtype']}{extra}{align}{late}{patched}")
            for name, v in (c.get("versions") or {}).items():
                meta = f"  {json.dumps(v['meta'], sort_keys=True)}" if v.get("meta") else ""
                lines.append(f"  {'':<{w}}  version {c['name']}@{name}: {v['rows']:,} rows in {v['patches']} "
                             f"patch{'' if v['patches'] == 1 else 'es'}{meta}")
    w = max([11] + [len(n) + 1 for n in info.get("stats", {})])
    for name, s in info.get("stats", {}).items():
        if s is None:
            lines.append(f"{name:<{w}} no values")
            continue
        lines.append(f"{name:<{w}} mean {s['mean']:.4g}  std {s['std']:.4g}  min {s['min']:.4g}  "
                     f"max {s['max']:.4g}  (n={s['count']:,})")
    return "\n".join(lines)
