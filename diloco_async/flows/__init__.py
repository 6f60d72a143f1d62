"""Prefect flows and deployments; thin wrappers around the library."""
