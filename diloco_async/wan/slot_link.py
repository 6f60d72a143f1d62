"""One learner of a chaos scenario behind a shaped link (issue 47: a heterogeneous fleet).

A chaos scenario's ``[link]`` (:class:`~diloco_async.chaos.scenario.LinkSlot`) puts one slot's
learner behind a link of a few Mbit/s. The kernel shapes it (``tc tbf`` between network
namespaces, :class:`~diloco_async.wan.netns.WanNet` with one region): that needs root. Every
byte the learner moves must cross the link, so the store cannot be a local folder: as in a WAN
run the store is moto's S3 server in the hub namespace, beside the synchronizer and the other
learners; only the link's learner sits in the region namespace. Its one-way ``delay_ms`` is
added by the learner itself (:data:`~diloco_async.runtime.link_delay.LINK_DELAY_ENV`; the kernel
has no ``netem``).

:func:`slot_link_placement` builds that placement (``shaped``), or, for the full-speed baseline
(``link.shaped = False``), the same S3 store on loopback with every process in this namespace;
:func:`link_skip_reason` says why a scenario's link cannot be built here (then the harness skips
that slot and reports it). The methods run as :class:`~diloco_async.wan.methods.WanDilocoTarget`
with a :class:`SlotLinkPlacement`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from diloco_async.chaos.scenario import LinkSlot, Scenario, method_config
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.runtime.link_delay import LINK_DELAY_ENV
from diloco_async.wan.methods import S3_TEST_ENV, WanPlacement

__all__ = ["LINK_REGION", "SlotLinkPlacement", "slot_link_placement", "link_skip_reason"]

#: the region name of the link's namespace
LINK_REGION = "link"


def link_skip_reason(link: LinkSlot | None) -> str | None:
    """Why ``link`` cannot be built on this machine (not root, no ``tc``/``tbf``), naming the
    slot; None when it can, or when there is no link or it is not shaped."""
    if link is None or not link.shaped:
        return None
    from diloco_async.wan.netns import root_reason

    why = root_reason()
    return None if why is None else f"its {link.up_mbit:g}/{link.down_mbit:g} Mbit/s link needs root and tc: {why}"


class SlotLinkPlacement(WanPlacement):
    """Where a run with one shaped slot goes: ``learner-{link.slot}`` in the link's region
    namespace, every other process (the synchronizer, the other learners) in the hub; without a
    net, every process here. The store is the S3 server at ``endpoint_url`` (``bucket`` exists)."""

    def __init__(self, sc: Scenario, link: LinkSlot, net, endpoint_url: str, bucket: str) -> None:
        super().__init__(sc, net, endpoint_url, bucket)  # type: ignore[arg-type] - ns_for/env_for/diloco_config are ours
        self.link = link

    def _is_link_learner(self, name: str) -> bool:
        return name == f"learner-{self.link.slot}"

    def ns_for(self, name: str) -> str | None:
        if self.net is None:
            return None
        return self.net.ns_of(LINK_REGION) if self._is_link_learner(name) else self.net.hub_ns

    def env_for(self, name: str) -> dict[str, str]:
        if self.net is None or not self._is_link_learner(name) or self.link.delay_ms <= 0:
            return {}
        return {LINK_DELAY_ENV: f"{self.link.delay_ms:g}"}

    def diloco_config(self, method: str, base: Config, seed: int | None, run_name: str) -> Config:
        """``method`` under the scenario (:func:`~diloco_async.chaos.scenario.method_config`) with the
        synchronizer in the hub, the store on the S3 server under ``run_name`` and no learner
        checkpoints (they would cross the link); ``seed`` (when given) is ``run.seed``."""
        host = self.net.hub_addr if self.net is not None else "127.0.0.1"
        fields = {"synchronizer.host": host, "run.store": f"s3://{self.bucket}/{run_name}",
                  "learners.checkpoint_every_s": 0.0,
                  "run.storage_options": {"client_kwargs": {"endpoint_url": self.endpoint_url}}}
        if seed is not None:
            fields["run.seed"] = int(seed)
        return with_fields(method_config(self.sc, method, base), fields)


@contextlib.contextmanager
def slot_link_placement(sc: Scenario, workdir: Path = Path(".local/runs")) -> Iterator[SlotLinkPlacement]:
    """The placement of a scenario with a ``[link]`` (module docstring): shaped, a one-region
    :class:`~diloco_async.wan.netns.WanNet` (its rate verified, else
    :class:`~diloco_async.wan.netns.LinkRateError`) with moto in its hub; unshaped, moto on
    loopback. Everything is stopped and torn down on the way out.

    Raises:
        ValueError: the scenario has no ``[link]``.
        RuntimeError: shaped but not possible here (:func:`link_skip_reason`).
    """
    from diloco_async.wan.place import loopback_moto, make_bucket

    link = sc.link
    if link is None:
        raise ValueError(f"scenario {sc.scenario.name} has no [link]")
    for k, v in S3_TEST_ENV.items():  # moto's credentials, inherited by every process of the run
        os.environ.setdefault(k, v)
    if not link.shaped:
        with loopback_moto(workdir / "link-moto.log") as url:
            yield SlotLinkPlacement(sc, link, None, url, make_bucket(url))
        return
    why = link_skip_reason(link)
    if why is not None:
        raise RuntimeError(f"slot {link.slot}: {why}")
    from diloco_async.wan.hubio import hub_mkdir
    from diloco_async.wan.launch import start_moto_server
    from diloco_async.wan.netns import LinkSpec, WanNet

    spec = LinkSpec(region=LINK_REGION, up_mbit=link.up_mbit, down_mbit=link.down_mbit, delay_ms=link.delay_ms)
    with WanNet([spec], tolerance=link.tolerance, verify_bytes=link.verify_bytes) as net:
        url, stop = start_moto_server(net)
        try:
            bucket = f"link-{uuid.uuid4().hex[:12]}"
            hub_mkdir(net, url, bucket)
            yield SlotLinkPlacement(sc, link, net, url, bucket)
        finally:
            stop()
