"""Where templates live ($WEIGHTSTREAM_HOME/templates/<spec key>.json) and how they are read back safely."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from weightstream.prefetch.spec import DeploymentSpec
from weightstream.prefetch.template import LoadTemplate, TemplateError


def home() -> Path:
    """$WEIGHTSTREAM_HOME, or ~/.cache/weightstream."""
    return Path(os.environ.get("WEIGHTSTREAM_HOME") or Path.home() / ".cache" / "weightstream")


def template_path(spec: DeploymentSpec) -> Path:
    """The template file for a spec."""
    return home() / "templates" / f"{spec.key}.json"


def save_template(template: LoadTemplate, spec: DeploymentSpec) -> Path:
    """Write atomically (temp file + rename), so a reader never sees half a template."""
    path = template_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(template.to_json())
    os.replace(tmp, path)
    return path


@dataclass(slots=True)
class Lookup:
    """The outcome of looking up a template: the template, or the one-line reason it is not used."""

    template: LoadTemplate | None
    reason: str
    path: Path


def find_template(spec: DeploymentSpec, check_files: bool = True) -> Lookup:
    """Read and validate the template for spec; never raises for a bad template, returns the reason instead."""
    path = template_path(spec)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Lookup(
            None,
            f"no template recorded for spec '{spec}' (record one with `weightstream prefetch record --spec ...`)",
            path,
        )
    except (OSError, UnicodeDecodeError) as exc:
        return Lookup(None, f"template {path} is unreadable ({exc})", path)
    try:
        template = LoadTemplate.from_json(text)
    except TemplateError as exc:
        return Lookup(None, f"template {path} is {exc}", path)
    reason = _mismatch(template, spec, check_files)
    return Lookup(None if reason else template, reason or "template matches", path)


def _mismatch(template: LoadTemplate, spec: DeploymentSpec, check_files: bool) -> str | None:
    if template.key != spec.key or template.spec != spec.as_dict():
        return f"template was recorded for another spec ({template.spec})"
    reason = template.check_ranges()
    if reason or not check_files:
        return reason
    for identity in template.files:
        reason = identity.mismatch()
        if reason:
            return reason
    return None
