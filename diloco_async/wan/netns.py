"""Emulated regions on one machine: a hub network namespace and one namespace per region, each
region joined to the hub by a veth pair shaped with ``tc tbf`` in both directions.

Topology and address plan (addresses exist only inside the namespaces made here; nothing routes
out of them)::

    region r_i  ({name}-{region})                         hub ({name}-hub)
      {name}r     10.77.i.2/30  <---- veth pair ---->  {name}h{i}  10.77.i.1/30
      route 10.77.0.0/16 via 10.77.i.1                 lo: 10.77.255.1/32 (hub_addr), ip_forward=1

* up (region -> hub): ``tbf`` on the egress of the region-side veth at ``up_mbit``;
  down (hub -> region): ``tbf`` on the egress of the hub-side veth at ``down_mbit``.
* Region-to-region traffic goes through the hub, so it crosses two shaped links.
* Servers in the hub (synchronizer, moto) bind :attr:`WanNet.hub_addr`, which every region reaches.
* The region side of every pair has the same name, :attr:`WanNet.region_ifname` (``{name}r``;
  interface names are per namespace), so one ``GLOO_SOCKET_IFNAME`` serves ranks in any region.
* IPv6 is disabled in every namespace, so the veth counters carry only the run's IPv4 traffic.
* Token bucket: ``burst`` = 5 ms of the rate, at least 8 full frames (12,112 bytes): small enough
  that a burst is a negligible part of a 1-2 s verification at a few Mbit/s, large enough for the
  kernel timer to keep the rate at high settings. ``latency`` 100 ms bounds the queue (rate x
  100 ms); TCP senders on the veth (small queues) rarely fill it. The kernel here has no
  ``netem``: :attr:`LinkSpec.delay_ms` is not applied by tc; users of the link add it in the
  application.
* Rates are SI (1 Mbit/s = 10^6 bit/s) on the wire (Ethernet frames); the verification measures
  TCP payload, about 4.4 % below the wire rate with 1,500-byte frames.

:class:`WanNet` builds all this on ``__enter__`` (then verifies every link, refusing to start with
:class:`LinkRateError` when one is outside ``±tolerance``) and always tears it down on ``__exit__``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_async.wan.netns_core import (
    call_in_netns,
    cleanup,
    enter_netns,
    list_netns,
    root_reason,
    run_cmd,
    teardown,
)
from diloco_async.wan.probe import timed_transfer, transfer_plan

__all__ = ["LinkSpec", "RegionNet", "WanNet", "LinkRateError", "root_reason", "cleanup", "enter_netns",
           "call_in_netns", "tbf_burst_bytes", "HUB_ADDR"]

log = logging.getLogger("diloco.wan")

NET_PREFIX = "10.77"
HUB_ADDR = f"{NET_PREFIX}.255.1"
MAX_REGIONS = 250
TBF_LATENCY_MS = 100
BURST_S = 0.005
FRAME_BYTES = 1514
BURST_MIN_BYTES = 8 * FRAME_BYTES
TAG_CHARS = 4
_REGION_RE = re.compile(r"[a-z0-9-]{1,8}\Z")
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,5}\Z")


class LinkRateError(RuntimeError):
    """A link measured outside ``±tolerance`` of its setting: the run refuses to start. The message
    lists every such direction with its set and measured Mbit/s."""


@dataclass(frozen=True)
class LinkSpec:
    """One region's link to the hub.

    Attributes:
        region: ``[a-z0-9-]{1,8}``, e.g. ``"r0"``.
        up_mbit / down_mbit: region -> hub / hub -> region rate, Mbit/s (10^6 bit/s), > 0.
        delay_ms: one-way latency to add, ms (>= 0). Not applied by tc (no netem in this kernel):
            the users of the link apply it in the application.

    Raises:
        ValueError: a bad region name, a rate that is not a positive finite number, a negative delay.
    """

    region: str
    up_mbit: float
    down_mbit: float
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not _REGION_RE.match(self.region):
            raise ValueError(f"region must match [a-z0-9-]{{1,8}}, got {self.region!r}")
        for field in ("up_mbit", "down_mbit"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{self.region}: {field} must be a positive number of Mbit/s, got {value!r}")
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"{self.region}: delay_ms must be >= 0, got {self.delay_ms!r}")


@dataclass(frozen=True)
class RegionNet:
    """Where a region lives: its namespace, its address (region side of its /30) and the hub's
    address on the same /30; ``hub_veth`` / ``region_veth`` name the two ends of its veth pair."""

    region: str
    ns: str
    addr: str
    hub_addr: str
    hub_veth: str = ""
    region_veth: str = ""


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Token-bucket size for ``rate_mbit``: 5 ms of the rate, at least 8 full frames (bytes)."""
    return max(BURST_MIN_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))


def _tbf_args(dev: str, rate_mbit: float) -> list[str]:
    return ["qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(round(rate_mbit * 1e6))}bit",
            "burst", str(tbf_burst_bytes(rate_mbit)), "latency", f"{TBF_LATENCY_MS}ms"]


def _new_name(prefix: str) -> str:
    alphabet = string.ascii_lowercase + string.digits
    taken = set(list_netns())
    for _ in range(20):
        name = prefix + "".join(secrets.choice(alphabet) for _ in range(TAG_CHARS))
        if not any(ns.startswith(name) for ns in taken):
            return name
    raise RuntimeError(f"no free namespace name with prefix {prefix!r} after 20 tries")


class WanNet:
    """The hub and region namespaces of an emulated WAN, as a context manager.

    Args:
        links: one :class:`LinkSpec` per region (distinct regions, at most 250).
        prefix: ``[a-z][a-z0-9]{0,5}``; every name made starts with it plus a random 4-character
            tag (:attr:`name`), so concurrent harnesses never share a name.
        verify: measure every link in both directions on ``__enter__`` (:meth:`verify`).
        tolerance: allowed relative error of a measured rate (0.15: ±15 %).
        verify_bytes: bytes per direction of each timed transfer (default: about 1.5 s at the rate).

    Raises:
        ValueError: no links, repeated regions, too many, a bad prefix or tolerance.
        LinkRateError (from ``__enter__``): a link outside tolerance; everything is torn down first.
        RuntimeError (from ``__enter__``): an ``ip``/``tc`` command failed (see :func:`root_reason`).

    Attributes:
        name: prefix + tag. hub_ns: the hub's namespace. hub_addr: the hub's address every region reaches.
        region_ifname: the name of the region-side veth, the same in every region's namespace.
        regions: region -> :class:`RegionNet`. verified: region -> ``{"up_mbit_set", "up_mbit_measured",
            "up_error", "down_mbit_set", "down_mbit_measured", "down_error"}`` (error: measured/set - 1).
    """

    def __init__(self, links: Sequence[LinkSpec], prefix: str = "dlw", verify: bool = True,
                 tolerance: float = 0.15, verify_bytes: int | None = None) -> None:
        links = list(links)
        if not links:
            raise ValueError("WanNet needs at least one LinkSpec")
        if len({spec.region for spec in links}) != len(links):
            raise ValueError(f"regions repeat: {[spec.region for spec in links]}")
        if len(links) > MAX_REGIONS:
            raise ValueError(f"at most {MAX_REGIONS} regions, got {len(links)}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must match [a-z][a-z0-9]{{0,5}} (interface names have 15 characters), "
                             f"got {prefix!r}")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
        self.links = links
        self.prefix = prefix
        self.verify_on_enter = verify
        self.tolerance = tolerance
        self.verify_bytes = verify_bytes
        self.name = ""
        self.hub_ns = ""
        self.region_ifname = ""
        self.hub_addr = HUB_ADDR
        self.regions: dict[str, RegionNet] = {}
        self.verified: dict[str, dict] = {}
        self.counters_at_ready: dict[str, dict] = {}
        self._made_ns: list[str] = []

    # -- life cycle -------------------------------------------------------------------------------

    def __enter__(self) -> WanNet:
        try:
            self.create()
            if self.verify_on_enter:
                self.verify()
            self.counters_at_ready = self.link_counters()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the namespaces, veth pairs, addresses, routes and qdiscs (see the module docstring).

        Raises:
            RuntimeError: an ``ip``/``tc`` command failed (what was made stays for :meth:`close`).
        """
        self.name = _new_name(self.prefix)
        self.hub_ns = f"{self.name}-hub"
        self.region_ifname = f"{self.name}r"
        self._add_ns(self.hub_ns)
        run_cmd(["ip", "-n", self.hub_ns, "addr", "add", f"{self.hub_addr}/32", "dev", "lo"])
        run_cmd(["ip", "netns", "exec", self.hub_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for i, spec in enumerate(self.links):
            self.regions[spec.region] = self._add_region(i, spec)
        log.info("WAN %s: hub %s at %s, regions %s", self.name, self.hub_ns, self.hub_addr,
                 {r: (n.ns, n.addr) for r, n in self.regions.items()})

    def _add_ns(self, ns: str) -> None:
        run_cmd(["ip", "netns", "add", ns])
        self._made_ns.append(ns)
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        for key in ("all", "default"):
            run_cmd(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"])

    def _add_region(self, i: int, spec: LinkSpec) -> RegionNet:
        rn = RegionNet(region=spec.region, ns=f"{self.name}-{spec.region}", addr=f"{NET_PREFIX}.{i}.2",
                       hub_addr=f"{NET_PREFIX}.{i}.1", hub_veth=f"{self.name}h{i}", region_veth=self.region_ifname)
        self._add_ns(rn.ns)
        run_cmd(["ip", "-n", self.hub_ns, "link", "add", rn.hub_veth, "type", "veth", "peer", "name",
                 rn.region_veth, "netns", rn.ns])
        run_cmd(["ip", "-n", self.hub_ns, "addr", "add", f"{rn.hub_addr}/30", "dev", rn.hub_veth])
        run_cmd(["ip", "-n", rn.ns, "addr", "add", f"{rn.addr}/30", "dev", rn.region_veth])
        run_cmd(["tc", "-n", rn.ns, *_tbf_args(rn.region_veth, spec.up_mbit)])
        run_cmd(["tc", "-n", self.hub_ns, *_tbf_args(rn.hub_veth, spec.down_mbit)])
        run_cmd(["ip", "-n", self.hub_ns, "link", "set", rn.hub_veth, "up"])
        run_cmd(["ip", "-n", rn.ns, "link", "set", rn.region_veth, "up"])
        run_cmd(["ip", "-n", rn.ns, "route", "add", f"{NET_PREFIX}.0.0/16", "via", rn.hub_addr])
        return rn

    def close(self) -> list[str]:
        """Tear down what :meth:`create` made: processes still inside its namespaces (SIGKILL, never
        this process), its veths and qdiscs, its namespaces. Safe to call twice; never raises for
        an item that could not go (logged). Returns what was removed."""
        links: list[tuple[str | None, str]] = [(self.hub_ns, rn.hub_veth) for rn in self.regions.values()]
        removed = teardown(list(reversed(self._made_ns)), links) if self._made_ns else []
        self._made_ns = []
        if removed:
            log.info("WAN %s torn down: %s", self.name, ", ".join(removed))
        return removed

    # -- verification -----------------------------------------------------------------------------

    def _measure(self, recv_ns: str, recv_addr: str, send_ns: str, rate_mbit: float) -> float:
        total, skip, timeout_s = transfer_plan(rate_mbit, tbf_burst_bytes(rate_mbit), self.verify_bytes)
        result = timed_transfer(recv_ns, recv_addr, send_ns, total, skip, timeout_s)
        log.info("WAN %s: %s -> %s set %.3f Mbit/s, measured %.3f Mbit/s (%d bytes steady in %.2f s%s)",
                 self.name, send_ns, recv_ns, rate_mbit, result.mbit, result.steady_bytes, result.steady_s,
                 ", cut at its deadline" if result.timed_out else "")
        return result.mbit

    def _measure_checked(self, recv_ns: str, recv_addr: str, send_ns: str, rate_mbit: float) -> float:
        """One timed transfer, and exactly one more when it lands outside ``±tolerance``: the sender
        and receiver are Python threads, and on a busy machine one CPU spike can starve a 1.5 s
        transfer. The second figure is the one judged; both are logged."""
        first = self._measure(recv_ns, recv_addr, send_ns, rate_mbit)
        if abs(first / rate_mbit - 1) <= self.tolerance:
            return first
        log.warning("WAN %s: %s -> %s measured %.3f Mbit/s of %.3f set, outside ±%.0f%%; measuring once more",
                    self.name, send_ns, recv_ns, first, rate_mbit, 100 * self.tolerance)
        return self._measure(recv_ns, recv_addr, send_ns, rate_mbit)

    def verify(self, expect: Sequence[LinkSpec] | None = None) -> dict[str, dict]:
        """Time a TCP transfer up and down every link (a direction outside ``±tolerance`` is measured
        once more, and that figure is judged) and compare with ``expect`` (default: the links as
        shaped). Fills and returns :attr:`verified` (Mbit/s, error = measured/set - 1).

        Raises:
            LinkRateError: some direction outside ``±tolerance``; :attr:`verified` holds every figure.
            OSError: a transfer could not connect (the link is down).
        """
        misses = []
        for spec in expect if expect is not None else self.links:
            rn = self.regions[spec.region]
            up = self._measure_checked(self.hub_ns, rn.hub_addr, rn.ns, spec.up_mbit)
            down = self._measure_checked(rn.ns, rn.addr, self.hub_ns, spec.down_mbit)
            fig = {"up_mbit_set": spec.up_mbit, "up_mbit_measured": up, "up_error": up / spec.up_mbit - 1,
                   "down_mbit_set": spec.down_mbit, "down_mbit_measured": down,
                   "down_error": down / spec.down_mbit - 1}
            self.verified[spec.region] = fig
            for way in ("up", "down"):
                if abs(fig[f"{way}_error"]) > self.tolerance:
                    misses.append(f"{spec.region} {way}: set {fig[f'{way}_mbit_set']:.3f} Mbit/s, measured "
                                  f"{fig[f'{way}_mbit_measured']:.3f} ({fig[f'{way}_error']:+.1%})")
        if misses:
            raise LinkRateError(f"WAN {self.name}: links outside ±{self.tolerance:.0%} of their setting, the run "
                                f"will not start: " + "; ".join(misses))
        return self.verified

    # -- lookups and counters -----------------------------------------------------------------------

    def ns_of(self, region: str | None) -> str:
        """The namespace of ``region`` (None: the hub).

        Raises:
            KeyError: an unknown region (the message lists the known ones).
        """
        if region is None:
            return self.hub_ns
        if region not in self.regions:
            raise KeyError(f"unknown region {region!r}; regions: {sorted(self.regions)}")
        return self.regions[region].ns

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` by ``ip netns exec``."""
        return ["ip", "netns", "exec", ns, *argv]

    def link_counters(self) -> dict[str, dict]:
        """Bytes each link carried since it was made (verification transfers included; subtract
        :attr:`counters_at_ready`, taken when ``__enter__`` finished, for the run's share):
        region -> ``{"up_bytes"`` (tx of the region-side veth), ``"down_bytes"`` (tx of the hub-side
        veth)``}``, Ethernet frames as the kernel counts them.

        Raises:
            RuntimeError: a veth is gone (the net was closed).
        """
        out = {}
        for region, rn in self.regions.items():
            out[region] = {"up_bytes": _tx_bytes(rn.ns, rn.region_veth),
                           "down_bytes": _tx_bytes(self.hub_ns, rn.hub_veth)}
        return out


def _tx_bytes(ns: str, dev: str) -> int:
    info = json.loads(run_cmd(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]))
    return int(info[0]["stats64"]["tx"]["bytes"])
