"""Checks of the multi-host rehearsal that run *inside* one emulated host (docs/multi-host.md):
``python -m diloco_async.flows.rehearsal_checks isolation|paths ...``, started by the rehearsal with
``nsenter`` into that host's worker's mount and network namespaces. Each prints one JSON object.

* ``isolation --own DIR --hidden DIR...``: from inside the host, each hidden folder (another
  machine's disk) is an empty read-only tmpfs, a file known to be there on its machine
  (``--probe PATH``) cannot be opened, and the host's own checkout is there.
* ``paths --mlflow URI --store URL --run-id ID``: every path the run recorded, in MLflow (artifact
  URIs and every artifact under them, model version sources, logged models, URL- or path-valued
  tags and params, path strings inside JSON artifacts) and in the store (every key under the run,
  path strings inside its JSON objects, the newest checkpoint with every digest), opened from this
  host. A local path (``/...`` or ``file://``) counts as unresolved: another host has no such file.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["isolation", "recorded_values", "resolve", "paths", "main"]

#: a value worth resolving: a URL with a scheme another host may open, or an absolute local path
_URI_RE = re.compile(r"^(s3://|gs://|file:|mlflow-artifacts:|runs:/|models:/|https?://|/)")
#: the largest artifact read in full (bigger ones: their size is compared)
READ_LIMIT_BYTES = 64 << 20


def _mounted_tmpfs(folder: str) -> bool:
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == folder and " - tmpfs " in line for line in fh)


def isolation(own: str, hidden: list[str], probes: list[str]) -> dict:
    """What this process sees of its own checkout and of the other machines' folders."""
    out: dict[str, Any] = {"mnt_ns": os.stat("/proc/self/ns/mnt").st_ino, "net_ns": os.stat("/proc/self/ns/net").st_ino,
                           "own_checkout": (Path(own) / "prefect.yaml").is_file(), "hidden": {}, "probes": {}}
    for folder in hidden:
        try:
            (Path(folder) / ".written-by-another-host").write_text("x")
            writable = True
        except OSError as err:
            writable = err.errno != errno.EROFS
        out["hidden"][folder] = {"entries": os.listdir(folder), "tmpfs": _mounted_tmpfs(folder), "writable": writable}
    for path in probes:
        try:
            with open(path, "rb"):
                out["probes"][path] = "opened"
        except FileNotFoundError:
            out["probes"][path] = "not found"
        except OSError as err:
            out["probes"][path] = f"error {err.errno}"
    return out


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """Every string inside a JSON value, with where it is (``where`` + its key path)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(value, str) and _URI_RE.match(value):
        yield where, value


def _json_payload(name: str, data: bytes) -> Any:
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return json.loads(data) if name.endswith(".json") else None


def recorded_values(client: Any, experiment_id: str, fs: Any, tracking_uri: str) -> Iterator[tuple[str, str]]:
    """(where, value) of every path MLflow recorded for ``experiment_id``'s runs and models. A UI
    path (``/#/...``, e.g. a chart view) is the tracking server's; a run's artifact folder counts
    once it holds an artifact (an object store has no empty folders)."""
    exp = client.get_experiment(experiment_id)
    yield f"experiment {exp.name} artifact_location", exp.artifact_location
    for run in client.search_runs([experiment_id]):
        rid = run.info.run_id
        for key, value in {**run.data.params, **run.data.tags}.items():
            if _URI_RE.match(value or ""):
                yield f"run {rid} {key}", f"{tracking_uri.rstrip('/')}{value}" if value.startswith("/#/") else value
        items = list(_artifacts(client, rid, ""))
        if items:
            yield f"run {rid} artifact_uri", run.info.artifact_uri
        for item in items:
            uri = f"{run.info.artifact_uri.rstrip('/')}/{item.path}"
            yield f"run {rid} artifact {item.path}", uri
            if item.path.endswith((".json", ".jsonl")) and (item.file_size or 0) < READ_LIMIT_BYTES:
                yield from _strings(_json_payload(item.path, fs.cat_file(uri)), f"run {rid} {item.path}")
    for version in client.search_model_versions():
        yield f"model {version.name}/{version.version} source", version.source
    for model in client.search_logged_models([experiment_id]):
        yield f"logged model {model.model_id} artifact_location", model.artifact_location


def _artifacts(client: Any, run_id: str, path: str) -> Iterator[Any]:
    for item in client.list_artifacts(run_id, path or None):
        if item.is_dir:
            yield from _artifacts(client, run_id, item.path)
        else:
            yield item


def resolve(value: str, fs: Any, tracking_uri: str) -> str | None:
    """None when ``value`` opens from here, else why not. s3:// objects or folders are opened
    (a folder: listed, non-empty); ``runs:/``, ``models:/`` and ``mlflow-artifacts:`` are
    downloaded through the tracking server; http(s) addresses answer below 500; a local path or
    ``file:`` URL never resolves (it names a file on the machine that wrote it)."""
    try:
        if value.startswith("s3://"):
            if fs.isfile(value):
                fs.cat_file(value, start=0, end=1)
                return None
            return None if fs.find(value) else "no object under it"
        if value.startswith(("runs:/", "models:/", "mlflow-artifacts:")):
            import mlflow

            with tempfile.TemporaryDirectory() as tmp:
                got = mlflow.artifacts.download_artifacts(value, dst_path=tmp, tracking_uri=tracking_uri)
                return None if any(Path(got).rglob("*")) or Path(got).is_file() else "downloaded nothing"
        if value.startswith(("http://", "https://")):
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                with opener.open(value, timeout=30) as resp:
                    return None if resp.status < 500 else f"HTTP {resp.status}"
            except urllib.error.HTTPError as err:
                return None if err.code < 500 else f"HTTP {err.code}"
        return "a local path: no other host has it"
    except Exception as err:  # noqa: BLE001 - the reason is the result
        return f"{type(err).__name__}: {err}"


def paths(tracking_uri: str, store: str, run_id: str) -> dict:
    """Resolve every recorded path of the run from this host (see the module docstring)."""
    import fsspec
    import mlflow
    from mlflow.tracking import MlflowClient

    from diloco_async.storage.checkpoint import latest_checkpoint
    from diloco_async.storage.options import storage_options_from_env
    from diloco_async.storage.store import ObjectStore

    mlflow.set_tracking_uri(tracking_uri)  # models:/ URIs resolve through the tracking server's registry
    mlflow.set_registry_uri(tracking_uri)
    options = storage_options_from_env()
    fs = fsspec.filesystem("s3", **options)
    client = MlflowClient(tracking_uri)
    values: list[tuple[str, str]] = []
    for exp in client.search_experiments():
        if exp.name != "Default":
            values += list(recorded_values(client, exp.experiment_id, fs, tracking_uri))
    prefix = f"{store.rstrip('/')}/{run_id}"
    keys = fs.find(prefix)
    for key in keys:
        values.append((f"store key {key}", f"s3://{key}"))
        if key.endswith((".json", ".jsonl")):
            values += list(_strings(_json_payload(key, fs.cat_file(key)), f"store {key}"))
    results = [{"where": where, "value": value, "error": resolve(value, fs, tracking_uri)} for where, value in values]
    ckpt = latest_checkpoint(ObjectStore(store, options), run_id)
    return {"mnt_ns": os.stat("/proc/self/ns/mnt").st_ino, "store_keys": len(keys), "resolved": results,
            "checkpoint_seq": None if ckpt is None else ckpt.seq}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_async.flows.rehearsal_checks")
    sub = parser.add_subparsers(dest="check", required=True)
    iso = sub.add_parser("isolation")
    iso.add_argument("--own", required=True)
    iso.add_argument("--hidden", action="append", default=[])
    iso.add_argument("--probe", action="append", default=[])
    pth = sub.add_parser("paths")
    pth.add_argument("--mlflow", required=True)
    pth.add_argument("--store", required=True)
    pth.add_argument("--run-id", required=True)
    ns = parser.parse_args(argv)
    if ns.check == "isolation":
        out = isolation(ns.own, ns.hidden, ns.probe)
    else:
        out = paths(ns.mlflow, ns.store, ns.run_id)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
