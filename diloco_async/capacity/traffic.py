"""Bytes on the links, the link rate that keeps learners from waiting, and DDP over the same links.

Steady state, per learner: each of the P fragments has a round every H inner steps, so a learner
uploads one contribution of every fragment and downloads one version of every fragment per H of
its steps (paper §3, DESIGN §3.4):

    up per step   = Σ_p up_nbytes[p] / H          down per step = Σ_p down_nbytes[p] / H

Once per learner and run: the fp32 model downloaded when it joins (it holds no version a delta
could apply to) and the last round of every fragment at the stop (one more contribution and one
more version each). On the wire each direction carries its payload in TCP segments of an
Ethernet MTU (``MTU / (MTU - 52)``: IPv4 and TCP headers with timestamps) and the ACKs of the
other direction (52 bytes per two segments). Heartbeats, announcements and HTTP headers are left
out (a few hundred bytes per message).

A region's link carries its L learners. Learners never wait on it when

* it carries the mean load: ``L × bytes per step / step_s``, each direction, and
* one fragment's round trip fits the overlap: ``L × (up + down of the largest fragment) /
  (τ × step_s)`` (the contribution must be in before its round merges, the version back before
  the learners move on; paper Eq. 3's ``τ·ξ_step``);

the larger of the two is the *no-wait* rate. DDP on the same devices all-reduces the gradients
every step with a ring across the R regions (inside a region the links are fast and left out):
``2 (R - 1) / R × params × grad bytes`` each way on every region's link per step, taking
``that / rate`` on the slowest link after the compute of the step (no overlap). The speed-up is
DDP's step time over Decoupled DiLoCo's, whose learners keep their compute pace as long as their
link carries the mean load (a link short of it passes that fraction of the contributions).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_async.capacity.inputs import GRAD_DTYPE_BYTES, PlanInputs
from diloco_async.capacity.sizes import FragmentSizes, shard_fragments

__all__ = ["MTU_BYTES", "IP_TCP_HEADER_BYTES", "SEGMENTS_PER_ACK", "wire_bytes", "LearnerTraffic", "RegionLink",
           "DdpBaseline", "ShardTraffic", "learner_traffic", "region_links", "ddp_baseline", "shard_traffic",
           "speedup"]

MTU_BYTES = 1500
IP_TCP_HEADER_BYTES = 52  # IPv4 20 + TCP 20 + the timestamp option 12
SEGMENTS_PER_ACK = 2  # delayed ACKs
FP32 = 4
GBIT = 1e9 / 8  # bytes per second in one Gbit/s


def wire_bytes(payload: float, other_way: float) -> float:
    """Bytes on the wire in one direction that carries ``payload`` bytes of TCP payload while the
    other direction carries ``other_way`` (whose ACKs travel this way)."""
    mss = MTU_BYTES - IP_TCP_HEADER_BYTES
    return payload * MTU_BYTES / mss + other_way * IP_TCP_HEADER_BYTES / (SEGMENTS_PER_ACK * mss)


@dataclass(frozen=True)
class LearnerTraffic:
    """One learner's traffic with the synchronizer's store (bytes; ``*_wire``: with the headers).

    ``up_per_step``/``down_per_step``: payload per inner step in steady state;
    ``join_down``/``drain_up``/``drain_down``: once per run; ``*_per_token``: on the wire per
    token the learner trains, steady state and (with a token budget) over the run."""

    tokens_per_step: int
    up_per_step: float
    down_per_step: float
    join_down: int
    drain_up: int
    drain_down: int
    up_wire_per_step: float
    down_wire_per_step: float
    up_per_token: float
    down_per_token: float
    run_tokens_per_learner: float | None
    run_up_per_token: float | None
    run_down_per_token: float | None


@dataclass(frozen=True)
class RegionLink:
    """One region's link to the hub (bytes per second and Gbit/s, on the wire; None without a
    step time or a rate). ``throughput`` is the fraction of its learners' contributions the link
    carries (1 when its rate covers the mean load)."""

    region: int
    learners: int
    rate_gbps: float | None
    up_bytes_per_s: float | None
    down_bytes_per_s: float | None
    run_up_bytes_per_s: float | None
    run_down_bytes_per_s: float | None
    mean_gbps: float | None
    round_trip_gbps: float | None
    no_wait_gbps: float | None
    utilisation: float | None
    throughput: float | None


@dataclass(frozen=True)
class DdpBaseline:
    """DDP on the same devices over the same links: per region link and step, each direction."""

    regions: int
    grad_dtype: str
    allreduce_bytes_per_step: float
    allreduce_wire_per_step: float
    bytes_per_token: float
    needed_gbps: float | None
    allreduce_s: float | None
    step_s: float | None
    bytes_per_s: float | None


@dataclass(frozen=True)
class ShardTraffic:
    """One synchronizer shard's traffic with the store (payload bytes per second; None without a
    step time): contributions fetched in, versions published out (the compact form and, with
    compressed downloads, the fp32 whole one)."""

    shard: int
    fragments: tuple[int, ...]
    in_bytes_per_s: float | None
    out_bytes_per_s: float | None


def learner_traffic(inp: PlanInputs, sizes: FragmentSizes) -> LearnerTraffic:
    """One learner's traffic (module docstring)."""
    h, tokens = inp.sync.sync_every, inp.learners.tokens_per_step
    up, down = sum(sizes.up_nbytes) / h, sum(sizes.down_nbytes) / h
    join, drain_up, drain_down = FP32 * inp.model.n_params, sum(sizes.up_nbytes), sum(sizes.down_nbytes)
    up_w, down_w = wire_bytes(up, down), wire_bytes(down, up)
    run_tokens = run_up = run_down = None
    if inp.budget_tokens is not None:
        run_tokens = inp.budget_tokens / inp.learners.count
        steps = run_tokens / tokens
        total_up, total_down = up * steps + drain_up, down * steps + drain_down + join
        run_up = wire_bytes(total_up, total_down) / run_tokens
        run_down = wire_bytes(total_down, total_up) / run_tokens
    return LearnerTraffic(tokens, up, down, join, drain_up, drain_down, up_w, down_w, up_w / tokens,
                          down_w / tokens, run_tokens, run_up, run_down)


def _learners_per_region(inp: PlanInputs) -> list[int]:
    out = [0] * inp.links.regions
    for i in range(inp.learners.count):
        out[i % inp.links.regions] += 1
    return out


def region_links(inp: PlanInputs, sizes: FragmentSizes, traffic: LearnerTraffic) -> list[RegionLink]:
    """Every region's link (module docstring)."""
    step_s, tau = inp.learners.step_s, inp.sync.overlap
    f = sizes.largest
    trip = wire_bytes(sizes.up_nbytes[f], sizes.down_nbytes[f]) + wire_bytes(sizes.down_nbytes[f], sizes.up_nbytes[f])
    out = []
    for r, n in enumerate(_learners_per_region(inp)):
        rate = inp.links.rate_gbps(r)
        if step_s is None:
            out.append(RegionLink(r, n, rate, *([None] * 9)))
            continue
        up_s, down_s = n * traffic.up_wire_per_step / step_s, n * traffic.down_wire_per_step / step_s
        run_up_s = run_down_s = None
        if traffic.run_up_per_token is not None and traffic.run_down_per_token is not None:
            per_s = n * traffic.tokens_per_step / step_s
            run_up_s, run_down_s = traffic.run_up_per_token * per_s, traffic.run_down_per_token * per_s
        mean = max(up_s, down_s) / GBIT
        round_trip = n * trip / (tau * step_s) / GBIT
        no_wait = max(mean, round_trip)
        out.append(RegionLink(r, n, rate, up_s, down_s, run_up_s, run_down_s, mean, round_trip, no_wait,
                              None if rate is None else mean / rate,
                              None if rate is None else min(1.0, rate / mean) if mean > 0 else 1.0))
    return out


def ddp_baseline(inp: PlanInputs) -> DdpBaseline:
    """DDP's ring all-reduce across the regions (module docstring)."""
    r = inp.links.regions
    grad = GRAD_DTYPE_BYTES[inp.links.ddp_grad_dtype] * inp.model.n_params
    ar = 2 * (r - 1) / r * grad
    ar_w = wire_bytes(ar, ar)
    tokens = inp.learners.count * inp.learners.tokens_per_step  # the same devices in one job
    step_s = inp.learners.step_s
    rates = [inp.links.rate_gbps(i) for i in range(r)]
    slowest = None if None in rates else min(rates)  # type: ignore[type-var]
    needed = None if step_s is None else ar_w / step_s / GBIT
    ar_s = None if slowest is None else ar_w / (slowest * GBIT)
    ddp_step = None if step_s is None or ar_s is None else step_s + ar_s
    return DdpBaseline(r, inp.links.ddp_grad_dtype, ar, ar_w, r * ar_w / tokens, needed, ar_s, ddp_step,
                       None if ddp_step is None else ar_w / ddp_step)


def shard_traffic(inp: PlanInputs, sizes: FragmentSizes) -> list[ShardTraffic]:
    """Each synchronizer shard's traffic with the store (module docstring)."""
    s, step_s = inp.sync, inp.learners.step_s
    out = []
    for i, frags in enumerate(shard_fragments(s.fragments, s.shards)):
        if step_s is None:
            out.append(ShardTraffic(i, tuple(frags), None, None))
            continue
        fetched = inp.learners.count * sum(sizes.up_nbytes[p] for p in frags)
        whole = sum(FP32 * sizes.numel[p] for p in frags) if s.download_codec != "fp32" else 0
        published = sum(sizes.down_nbytes[p] for p in frags) + whole
        out.append(ShardTraffic(i, tuple(frags), fetched / (s.sync_every * step_s),
                                published / (s.sync_every * step_s)))
    return out


def speedup(inp: PlanInputs, links: list[RegionLink], ddp: DdpBaseline) -> float | None:
    """DDP's step time over Decoupled DiLoCo's effective one on the same links (module
    docstring); None without a step time and a rate for every region."""
    step_s = inp.learners.step_s
    if step_s is None or ddp.step_s is None or any(link.throughput is None for link in links):
        return None
    carried = sum(link.learners * link.throughput for link in links) / inp.learners.count  # type: ignore[operator]
    return ddp.step_s / (step_s / carried)
