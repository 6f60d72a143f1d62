"""Key layout of a run (DESIGN §5). Zero-padded numbers keep listing order numeric."""

from __future__ import annotations

__all__ = ["plan_key", "config_key", "contribution_key", "version_key", "checkpoint_prefix",
           "checkpoint_state_key", "checkpoint_manifest_key", "learner_prefix"]


def plan_key(run_id: str) -> str:
    return f"{run_id}/plan.json"


def config_key(run_id: str) -> str:
    return f"{run_id}/config.json"


def contribution_key(run_id: str, fragment: int, round_n: int, learner: str, nonce: str) -> str:
    return f"{run_id}/contrib/p{fragment:03d}/r{round_n:08d}/{learner}-{nonce}.safetensors"


def version_key(run_id: str, fragment: int, version: int) -> str:
    return f"{run_id}/globals/p{fragment:03d}/v{version:08d}.safetensors"


def checkpoint_prefix(run_id: str) -> str:
    return f"{run_id}/checkpoints"


def checkpoint_state_key(run_id: str, seq: int) -> str:
    return f"{run_id}/checkpoints/{seq:08d}/state.safetensors"


def checkpoint_manifest_key(run_id: str, seq: int) -> str:
    return f"{run_id}/checkpoints/{seq:08d}/manifest.json"


def learner_prefix(run_id: str, learner: str) -> str:
    return f"{run_id}/learners/{learner}"
