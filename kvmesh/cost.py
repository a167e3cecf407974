"""Load-vs-recompute cost model: load a cached prefix only where that is cheaper than computing it.

    LinkModel      time to move `nbytes` from one source (a tier, a peer link, host->GPU): latency + bytes /
                   bandwidth, fitted by least squares over the most recent observed transfers, starting from a
                   calibrated or configured prior
    PrefillModel   time to prefill `n_new` tokens after `n_past` cached ones, for one model:
                   c + a * n_new + b * n_new * (n_past + n_new / 2)  (linear layers + attention), fitted over the
                   most recent observed prefills
    CostModel      one PrefillModel and a LinkModel per source; `plan(...)` picks, over whole chunks, how much of
                   a match to load, and whether to compute a front part while the rest loads (Cake, arXiv
                   2410.03065), and says why

A model with no observations yet has no opinion: the plan then loads the whole match (reason "no estimate").
All methods are pure except `observe_*`, which mutate the fit.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 64  # observations kept per model


def _lstsq(rows: list[list[float]], ys: list[float], prior: np.ndarray | None = None) -> np.ndarray:
    """Least squares of relative error (each observation weighted by 1 / its time): a 10 ms prefill is fitted
    as well as a 1 s one, so short prompts are not misjudged by a fit that only the long ones shaped. Callers
    pass at least one row."""
    assert rows, "a fit needs an observation"
    a, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    a, y = a * w[:, None], y * w
    if prior is not None:  # a weak pull toward the prior keeps a few observations from running away
        w = 1e-3 * max(1.0, float(np.abs(a).max()))
        a = np.vstack([a, w * np.eye(len(prior))])
        y = np.concatenate([y, w * prior])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return np.maximum(coef, 0.0)  # time never shrinks with more work


class LinkModel:
    """seconds(nbytes) = latency + nbytes / bandwidth."""

    def __init__(self, bandwidth_bps: float, latency_s: float) -> None:
        self._prior = np.array([latency_s, 1.0 / bandwidth_bps])
        self._obs: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._coef = self._prior.copy()
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        with self._lock:
            self._obs.append((float(nbytes), float(seconds)))
            rows = [[1.0, b] for b, _ in self._obs]
            ys = [s for _, s in self._obs]
            # scale bytes so both columns are O(1) for the solver
            scale = max(b for b, _ in self._obs)
            coef = _lstsq([[1.0, b / scale] for _, b in rows], ys, np.array([self._prior[0], self._prior[1] * scale]))
            self._coef = np.array([coef[0], coef[1] / scale])

    def seconds(self, nbytes: int) -> float:
        lat, inv_bw = self._coef
        return float(lat + nbytes * inv_bw) if nbytes > 0 else 0.0

    @property
    def bandwidth_bps(self) -> float:
        return 1.0 / self._coef[1] if self._coef[1] > 0 else float("inf")

    @property
    def latency_s(self) -> float:
        return float(self._coef[0])


class PrefillModel:
    """seconds(n_new, n_past) = c + a * n_new + b * n_new * (n_past + n_new / 2)."""

    def __init__(self) -> None:
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._coef: np.ndarray | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _row(n_new: float, n_past: float) -> list[float]:
        return [1.0, n_new, n_new * (n_past + n_new / 2.0)]

    def observe(self, n_new: int, n_past: int, seconds: float) -> None:
        if n_new <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        with self._lock:
            self._obs.append((float(n_new), float(n_past), float(seconds)))
            s1 = max(o[0] for o in self._obs)
            s2 = max(o[0] * (o[1] + o[0] / 2) for o in self._obs)
            rows = [[1.0, o[0] / s1, o[0] * (o[1] + o[0] / 2) / s2] for o in self._obs]
            coef = _lstsq(rows, [o[2] for o in self._obs])
            self._coef = np.array([coef[0], coef[1] / s1, coef[2] / s2])

    @property
    def ready(self) -> bool:
        return self._coef is not None

    def seconds(self, n_new: int, n_past: int = 0) -> float | None:
        if self._coef is None:
            return None
        if n_new <= 0:
            return 0.0
        return float(np.dot(self._coef, self._row(n_new, n_past)))


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to do with a match of `matched` chunks: compute chunks [0, front) while loading [front, end),
    then prefill the rest of the prompt. `end == 0` means recompute everything."""

    front: int
    end: int
    reason: str  # "load", "split", "recompute", "no estimate", "no match"
    est_reuse_s: float | None = None  # estimated time to the end of prefill with this plan
    est_recompute_s: float | None = None  # ... with plain recompute

    @property
    def load_chunks(self) -> int:
        return self.end - self.front


class CostModel:
    """`margin`: a plan must be estimated at least this much faster than the next simpler one (recompute, then
    load-all) to be chosen. Estimates are fits of noisy observations, and overlap is never perfect; the margin
    is what keeps reuse from ever losing to recompute when the two are close."""

    def __init__(self, sources: dict[str, LinkModel] | None = None, margin: float = 0.9) -> None:
        self.prefill = PrefillModel()
        self.links: dict[str, LinkModel] = dict(sources or {})
        self.margin = margin

    def link(self, source: str) -> LinkModel:
        if source not in self.links:
            self.links[source] = LinkModel(bandwidth_bps=1e9, latency_s=1e-3)  # a modest guess
        return self.links[source]

    def observe_transfer(self, source: str, nbytes: int, seconds: float) -> None:
        self.link(source).observe(nbytes, seconds)

    def plan(
        self, prompt_tokens: int, chunk_tokens: int, chunk_bytes: int, sources: list[str], allow_split: bool = True
    ) -> LoadPlan:
        """Plan for a match whose chunk i comes from `sources[i]` (a link name per matched chunk). Vectorised
        over chunk counts: a 512-chunk match plans in well under a millisecond."""
        m = len(sources)
        if m == 0:
            return LoadPlan(0, 0, "no match")
        recompute = self.prefill.seconds(prompt_tokens, 0)
        if recompute is None:
            return LoadPlan(0, m, "no estimate")
        names = sorted(set(sources))
        # per source: how many of chunks [0, i) it carries, for i = 0..m
        counts = {s: np.concatenate([[0], np.cumsum([x == s for x in sources])]) for s in names}

        def load(first: np.ndarray, end: np.ndarray) -> np.ndarray:
            """Seconds to load chunks [first, end): one transfer per source (its latency counted once), the
            sources in parallel (the fetcher begins every run at once: this node's slab is read while peers'
            runs are received on pool threads), so the slowest source's time, not the sum."""
            total = np.zeros(np.broadcast(first, end).shape)
            for s in names:
                nbytes = (counts[s][end] - counts[s][first]) * chunk_bytes
                link = self.link(s)
                total = np.maximum(total, np.where(nbytes > 0, link.latency_s + nbytes / link.bandwidth_bps, 0.0))
            return total

        coef = self.prefill._coef
        assert coef is not None  # (the estimate above came from it)
        ks = np.arange(m + 1)

        def prefill(n_new: np.ndarray, n_past: np.ndarray) -> np.ndarray:
            return np.where(n_new > 0, coef[0] + coef[1] * n_new + coef[2] * n_new * (n_past + n_new / 2), 0.0)

        rest = prefill(prompt_tokens - ks * chunk_tokens, ks * chunk_tokens)  # after chunks [0, k) are there
        t_load = load(np.zeros_like(ks), ks) + rest
        best = LoadPlan(0, 0, "recompute", None, recompute)
        k = int(np.argmin(t_load[1:])) + 1
        if t_load[k] < self.margin * recompute:
            best = LoadPlan(0, k, "load", float(t_load[k]), recompute)
        if allow_split and m > 1:
            for end in sorted({k, m} - {0, 1}):
                fs = np.arange(1, end)
                t = np.maximum(prefill(fs * chunk_tokens, 0 * fs), load(fs, np.full_like(fs, end))) + rest[end]
                i = int(np.argmin(t))
                if t[i] < self.margin * (best.est_reuse_s if best.est_reuse_s is not None else recompute):
                    best = LoadPlan(int(fs[i]), end, "split", float(t[i]), recompute)
        return best


def measure_memcpy_bps(nbytes: int = 32 << 20) -> float:
    """A quick host memcpy calibration for the same-node source."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return nbytes / max(time.perf_counter() - t0, 1e-9)
