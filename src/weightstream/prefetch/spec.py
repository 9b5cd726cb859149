"""Deployment specs: the KEY=VALUE pairs that name one way of loading one model."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from weightstream.errors import WeightstreamError


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """A deployment spec, e.g. model=qwen3-30b tp=2 loader=vllm; order of pairs does not matter."""

    items: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, pairs: list[str]) -> DeploymentSpec:
        """Parse ["model=x", "tp=2"]; repeated keys and pairs without '=' are user errors."""
        if not pairs:
            raise WeightstreamError("--spec is empty; name the deployment, e.g. --spec model=qwen3-30b tp=1")
        seen: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise WeightstreamError(f"--spec item {pair!r} is not KEY=VALUE; write e.g. model=qwen3-30b")
            if key in seen:
                raise WeightstreamError(f"--spec key {key!r} is given twice ({seen[key]!r}, {value!r}); keep one")
            seen[key.strip()] = value
        return cls(tuple(sorted(seen.items())))

    @property
    def key(self) -> str:
        """The service id: a hash of the canonical spec, stable across pair order."""
        canonical = json.dumps(self.items, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:24]

    def as_dict(self) -> dict[str, str]:
        """The spec as a plain dict (for the template file and reports)."""
        return dict(self.items)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.items)
