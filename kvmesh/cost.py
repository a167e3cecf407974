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
All methods are pure except `observe_*`, which mutate the fit, and a link's estimates, which go back to its prior
once it has not been observed for FORGET_S.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 64  # observations kept per model
FORGET_S = 30.0  # a link's observations this old are forgotten: its prior again (the plan loads, and re-measures)
MAX_LINKS = 256  # link models kept before those of peers not observed lately go
SHIFT_N, SHIFT_X = 3, 4.0  # this many transfers in a row this many times slower (or faster) than the fit: a new
# regime, and the older observations go (a fit of relative error follows the fast ones, 500 to 1 at 2 ms vs 1 s)


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
    """seconds(nbytes) = latency + nbytes / bandwidth.

    The fit follows the link as it changes: SHIFT_N transfers in a row SHIFT_X times off the fit start it anew from
    them (a peer that became slow is not used for a whole window of requests), and a link not observed for
    FORGET_S is its prior again (one slow transfer, or a peer that hung once, does not keep the plan from ever
    loading over it again: the next load re-measures it)."""

    def __init__(self, bandwidth_bps: float, latency_s: float) -> None:
        self._prior = np.array([latency_s, 1.0 / bandwidth_bps])
        self._obs: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._coef = self._prior.copy()
        self._last_at = -math.inf  # when the last observation came
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._last_at > FORGET_S:
                self._obs.clear()
            fitted = self._coef if self._obs else self._prior
            self._obs.append((float(nbytes), float(seconds)))
            self._last_at = now
            recent = list(self._obs)[-SHIFT_N:]
            if len(self._obs) > SHIFT_N and len(recent) == SHIFT_N:
                ratios = [s / max(fitted[0] + b * fitted[1], 1e-9) for b, s in recent]
                if all(r > SHIFT_X for r in ratios) or all(r < 1.0 / SHIFT_X for r in ratios):
                    self._obs = deque(recent, maxlen=WINDOW)
            rows = [[1.0, b] for b, _ in self._obs]
            ys = [s for _, s in self._obs]
            # scale bytes so both columns are O(1) for the solver
            scale = max(b for b, _ in self._obs)
            coef = _lstsq([[1.0, b / scale] for _, b in rows], ys, np.array([self._prior[0], self._prior[1] * scale]))
            self._coef = np.array([coef[0], coef[1] / scale])

    def _now(self) -> np.ndarray:
        """The fit, or the prior when the link has not been observed for FORGET_S."""
        return self._coef if time.monotonic() - self._last_at <= FORGET_S else self._prior

    def seconds(self, nbytes: int) -> float:
        lat, inv_bw = self._now()
        return float(lat + nbytes * inv_bw) if nbytes > 0 else 0.0

    @property
    def bandwidth_bps(self) -> float:
        inv_bw = self._now()[1]
        return 1.0 / inv_bw if inv_bw > 0 else float("inf")

    @property
    def latency_s(self) -> float:
        return float(self._now()[0])


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
        self._links_lock = threading.Lock()  # a client plans and observes from several threads at once

    def link(self, source: str) -> LinkModel:
        """The model of `source`. "<kind>:<node id>" (one peer's link) starts from the prior of "<kind>"."""
        found = self.links.get(source)
        if found is not None:
            return found
        with self._links_lock:  # (adding and pruning unlocked: "dictionary changed size during iteration" out of
            found = self.links.get(source)  # a lookup, or a KeyError where two threads pruned one link)
            if found is not None:
                return found
            if len(self.links) >= MAX_LINKS:  # peers' links not observed for FORGET_S are their priors anyway: a
                now = time.monotonic()  # cluster's node ids over weeks (replaced machines) do not pile up
                for name in [n for n, m in list(self.links.items()) if ":" in n and now - m._last_at > FORGET_S]:
                    self.links.pop(name, None)
            base = self.links.get(source.split(":", 1)[0])
            made = self.links[source] = (
                LinkModel(1.0 / base._prior[1], float(base._prior[0]))
                if base is not None and ":" in source
                else LinkModel(bandwidth_bps=1e9, latency_s=1e-3)  # a modest guess
            )
            return made

    def observe_transfer(self, source: str, nbytes: int, seconds: float) -> None:
        """A transfer over `source`; one over a peer's own link is also one of its kind's (what a router prices
        for a node it has no link to, `routing`)."""
        self.link(source).observe(nbytes, seconds)
        if ":" in source:
            self.link(source.split(":", 1)[0]).observe(nbytes, seconds)

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
