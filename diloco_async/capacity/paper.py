"""The paper's production setting, planned and printed beside the paper's own figures.

The paper (Douillard et al. 2026, the DeepMind post) trained a 12B model across 4 US regions over
2-5 Gbps links, more than 20x faster than conventional synchronization, and reports the
cross-datacenter bandwidth falling from 198 Gbps (data-parallel) to 0.84 Gbps. It gives H = P = 24,
τ = 2 and bf16 outer gradients (int4 near lossless, Table 10); not the step time, the batch, the
learners per region, the devices per learner or the codec of the broadcast fragments.

What this module assumes where the paper is silent (each said in :data:`ASSUMPTIONS`): one learner
per region; broadcasts in the uploads' codec; DDP all-reducing fp32 gradients in a ring across the
regions; and the step time at which that all-reduce needs the paper's 198 Gbps to fit in one step,
so DDP's rate is the paper's by construction and the figures to compare are Decoupled DiLoCo's rate,
the ratio and the speed-ups. ``docs/capacity-plan.md`` explains the differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_async.capacity.inputs import GRAD_DTYPE_BYTES, LearnerSetup, LinkSetup, PlanInputs, SyncSetup
from diloco_async.capacity.plan import Plan, make_plan
from diloco_async.capacity.shapes import shape_from_count
from diloco_async.capacity.traffic import GBIT, wire_bytes

__all__ = ["PAPER", "ASSUMPTIONS", "PaperRow", "PaperComparison", "paper_inputs", "anchored_step_s",
           "paper_comparison"]

#: the paper's figures for its production run ([P]/[B] in /work/shared/research/paper.md §1, §6.1, §2.1)
PAPER = {
    "params": 12_000_000_000,
    "regions": 4,
    "link_gbps": (2.0, 5.0),
    "sync_every": 24,
    "fragments": 24,
    "overlap": 2,
    "codec": "bf16",
    "ddp_gbps": 198.0,
    "decoupled_gbps": 0.84,
    "speedup_at_least": 20.0,
}

#: what the plan assumes where the paper gives nothing
ASSUMPTIONS = (
    "1 learner per region (M = 4)",
    "published fragments travel in the uploads' codec",
    "DDP all-reduces fp32 gradients in a ring across the 4 regions every step",
    "the step time is the one at which that all-reduce needs the paper's 198 Gbps (DDP's rate is the anchor)",
    "fsdp over 256 devices per learner, 4096 tokens per device per step (memory and bytes per token only)",
)

DEVICES, CONTEXT = 256, 4096


@dataclass(frozen=True)
class PaperRow:
    """One figure: the plan's prediction beside the paper's (``paper`` as the paper states it)."""

    figure: str
    predicted: float
    paper: str
    unit: str


@dataclass(frozen=True)
class PaperComparison:
    """The rows, the anchored step time and the plans behind them (``plans[codec][gbps]``)."""

    step_s: float
    rows: tuple[PaperRow, ...]
    plans: dict[str, dict[float, Plan]]


def anchored_step_s(ddp_grad_dtype: str = "fp32") -> float:
    """Seconds of a step at which DDP's ring all-reduce of the paper's model across its regions
    (on the wire) needs exactly the paper's DDP rate to fit in one step."""
    r, n = PAPER["regions"], PAPER["params"]
    ar = 2 * (r - 1) / r * GRAD_DTYPE_BYTES[ddp_grad_dtype] * n
    return wire_bytes(ar, ar) / (PAPER["ddp_gbps"] * GBIT)


def paper_inputs(codec: str, link_gbps: float, step_s: float, *, ddp_grad_dtype: str = "fp32",
                 shards: int = 1) -> PlanInputs:
    """The paper's production setting with ``codec`` both ways, every link at ``link_gbps``."""
    return PlanInputs(
        model=shape_from_count(PAPER["params"]),
        learners=LearnerSetup(count=PAPER["regions"], devices=DEVICES, parallelism="fsdp", accelerator=True,
                              batch_per_rank=1, context=CONTEXT, precision="bf16", step_s=step_s),
        sync=SyncSetup(sync_every=PAPER["sync_every"], fragments=PAPER["fragments"], overlap=PAPER["overlap"],
                       shards=shards, codec=codec, download_codec=codec),
        links=LinkSetup(regions=PAPER["regions"], gbps=(link_gbps,), ddp_grad_dtype=ddp_grad_dtype))


def paper_comparison(*, ddp_grad_dtype: str = "fp32", shards: int = 1) -> PaperComparison:
    """Plan the paper's setting with bf16 (its default) and int4 (its near-lossless option) at
    both ends of its link rates, and set each figure beside the paper's."""
    step_s = anchored_step_s(ddp_grad_dtype)
    plans = {codec: {g: make_plan(paper_inputs(codec, g, step_s, ddp_grad_dtype=ddp_grad_dtype, shards=shards))
                     for g in PAPER["link_gbps"]} for codec in ("bf16", "int4")}
    low, high = PAPER["link_gbps"]
    ratio = PAPER["ddp_gbps"] / PAPER["decoupled_gbps"]
    any_plan = plans["bf16"][low]
    assert any_plan.ddp.needed_gbps is not None
    rows = [PaperRow(f"DDP all-reduce ({ddp_grad_dtype}) in one step: link rate", any_plan.ddp.needed_gbps,
                     f"{PAPER['ddp_gbps']:g} (the anchor)", "Gbit/s")]
    for codec in ("bf16", "int4"):
        p = plans[codec][low]
        assert p.links[0].mean_gbps is not None and p.bandwidth_ratio is not None
        rows += [PaperRow(f"Decoupled DiLoCo, {codec} both ways: link rate (mean)", p.links[0].mean_gbps,
                          f"{PAPER['decoupled_gbps']:g}", "Gbit/s"),
                 PaperRow(f"DDP / Decoupled DiLoCo rate, {codec}", p.bandwidth_ratio, f"{ratio:.0f}", "x")]
    for codec in ("bf16", "int4"):
        for g in (low, high):
            s = plans[codec][g].speedup
            assert s is not None
            rows.append(PaperRow(f"speed-up over DDP at {g:g} Gbit/s, {codec}", s,
                                 f"> {PAPER['speedup_at_least']:g}", "x"))
    return PaperComparison(step_s, tuple(rows), plans)
