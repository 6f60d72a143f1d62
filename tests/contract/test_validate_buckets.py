"""`diloco-async validate` against S3 buckets on moto's server: an unreachable bucket is named as
``run.store``, a writable one passes and is left empty (issue 15)."""

from __future__ import annotations

from diloco_async.flows.cli import main
from diloco_async.validate import validate_recipe


def test_unreachable_bucket_names_run_store(s3_endpoint, capsys):
    opts = s3_endpoint.storage_options["client_kwargs"]["endpoint_url"]
    argv = ["validate", "default", "--set", "run.store=s3://no-such-bucket-validate/runs",
            "--set", f'run.storage_options={{client_kwargs={{endpoint_url="{opts}"}}}}']
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "FAIL store" in out.out and "run.store" in out.err, out.out
    # the store's own answer ended the probe (a missing bucket is not retried), not a timeout or
    # dropped connections retried to the probe's deadline
    fail = next(line for line in out.out.splitlines() if line.startswith("FAIL store"))
    assert "FileNotFoundError" in fail and "bucket does not exist" in fail, fail


def test_writable_bucket_passes_and_is_left_empty(s3_endpoint):
    import fsspec

    from storage_servers import make_bucket

    bucket = make_bucket("s3", s3_endpoint.storage_options)
    checks = validate_recipe("default", [f"run.store=s3://{bucket}/runs"], s3_endpoint.storage_options)
    store = [c for c in checks if c.name == "store"][0]
    assert store.ok, store.detail
    assert fsspec.filesystem("s3", **s3_endpoint.storage_options).find(bucket) == []
