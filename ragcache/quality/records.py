"""Calibration records: what ``ragcache calibrate`` measured for an index, as its folder keeps them.

Owns: :class:`RatioScore` (blend at one ratio against full prefill), :class:`Calibration` (one
calibration of an index for one model and selection strategy) and reading and writing them in the
index folder's ``calibration.json``, keyed by model fingerprint and selection. Measured by
:mod:`ragcache.calibrate`; read by the pipeline (``ratio = "auto"``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ragcache.index.folder import CALIBRATION
from ragcache.quality.table import QualityTable

log = logging.getLogger("ragcache.index")  # the name these warnings have always been logged under

#: a ratio whose blend recomputed at least this share of the context tokens recomputed the whole
#: context (:attr:`RatioScore.whole_context`)
WHOLE_CONTEXT_SHARE = 0.999


@dataclass
class RatioScore:
    """Blend at one ratio against full prefill, means over the prompts (``ragcache calibrate``).

    Attributes:
        ratio: recompute ratio in [0, 1].
        kl_mean: mean first-token KL(full || blend), nats.
        answer_nll_rel: mean NLL of full's own greedy answer under blend / under full - 1.
        ttft_median_s: median blend TTFT, seconds.
        meets: good enough and worth it: every quality target met and ``speedup >= min_speedup``.
        loop_share: share of blend's answers with a repetition loop.
        speedup: median full-prefill TTFT / median blend TTFT of the same prompts.
        good: the quality targets are met (KL, answer NLL, loops no more often than full's).
        recomputed_share: mean share of the context's tokens the blend actually recomputed: above
            ``ratio`` where ``blend.min_recompute_tokens`` raised a short context's budget (then
            ratios below it recompute the same tokens), and by the rounding to runs of
            ``blend.granule`` tokens; None in records written before it was measured.
        mass_left: the adaptive budget's threshold measured (``blend.mass_left``: the share of the
            question's attention left on reused KV), or None for a fixed budget at ``ratio``.
    """

    ratio: float
    kl_mean: float
    answer_nll_rel: float | None
    ttft_median_s: float
    meets: bool
    loop_share: float = 0.0
    speedup: float | None = None
    good: bool | None = None
    recomputed_share: float | None = None
    mass_left: float | None = None

    @property
    def raised_by_floor(self) -> bool:
        """The share recomputed exceeds the ratio by more than 2 points: ``blend.min_recompute_tokens``
        raised the budget (runs of ``blend.granule`` tokens and forced tokens add less on 1k+ token
        contexts). Ratios raised to the same floor recompute the same tokens."""
        return (self.mass_left is None and self.recomputed_share is not None
                and self.recomputed_share > self.ratio + 0.02)

    @property
    def whole_context(self) -> bool:
        """The blend recomputed (nearly) every context token: ratio 1, or contexts no longer than
        ``blend.min_recompute_tokens``. That is full prefill through the blend's own path, never
        faster than vLLM's: such a ratio is never recorded, whatever its measured speedup (which is
        then load noise)."""
        return self.recomputed_share is not None and self.recomputed_share >= WHOLE_CONTEXT_SHARE


@dataclass
class Calibration:
    """The outcome of one calibration of an index for one model and selection strategy, as
    ``calibration.json`` keeps it (measured by :func:`ragcache.calibrate.calibrate`).

    Attributes:
        ratio: the smallest ratio that met every target, or None when none did (use ``--mode full``);
            with an adaptive budget, the ratio its budget is centred on.
        mass_left: with an adaptive budget (``blend.budget``), the largest ``blend.mass_left`` (the
            cheapest budget) that met every target; None for a fixed budget or when none did.
        max_kl: the KL target, nats.
        selection: the token-selection strategy measured.
        model_fingerprint: the model measured (its chunk KV is what was blended).
        n: prompts measured. source: ``"questions"`` (users' questions) or ``"probes"``.
        full_ttft_median_s: median full-prefill TTFT of the same prompts, seconds.
        scores: one :class:`RatioScore` per ratio tried, ascending.
        created: UTC time, ISO 8601.
        max_nll_rel: the answer-NLL target (relative to full's). min_speedup: the speed target.
        full_loop_share: share of full prefill's answers with a repetition loop.
        recommendation: ``"blend"`` (at ``ratio``) or ``"full"``; ``reason`` says why in one sentence.
        settings: what the blends were measured under: the blend settings that change what a blend
            at a ratio computes (:meth:`ragcache.config.BlendSettings.calibrated_settings`),
            ``"engine.dtype"`` (the resolved dtype) and ``"host"`` (the kind of host,
            :func:`ragcache.engine.route.host_class`); None in records written before it was kept.
            A calibration holds only under the same values (:meth:`changed`).
        quality: blend's answer quality per prompt-length and passage-length class
            (:meth:`QualityTable.to_list`), which ``engine.mode = "auto"`` routes by; None when not measured.
    """

    ratio: float | None
    max_kl: float
    selection: str
    model_fingerprint: str
    n: int
    source: str
    full_ttft_median_s: float
    scores: list[RatioScore] = field(default_factory=list)
    created: str = ""
    max_nll_rel: float = 0.05
    min_speedup: float = 1.2
    full_loop_share: float = 0.0
    recommendation: str = "blend"
    reason: str = ""
    settings: dict[str, Any] | None = None
    mass_left: float | None = None
    quality: list[dict[str, Any]] | None = None

    @property
    def quality_table(self) -> "QualityTable | None":
        """:attr:`quality` as a :class:`QualityTable`, or None when not measured."""
        return QualityTable.from_list(self.quality)

    def changed(self, current: dict[str, Any]) -> list[str]:
        """The settings whose value in ``current`` (same keys as :attr:`settings`) differs from the
        one measured, as ``"blend.granule = 16 (calibrated with 8)"``; [] when the calibration holds
        (also for a record that kept no settings: it cannot be checked)."""
        if self.settings is None:
            return []
        return [f"{name} = {current.get(name)!r} (calibrated with {self.settings.get(name)!r})"
                for name in sorted(set(self.settings) | set(current)) if self.settings.get(name) != current.get(name)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        """Inverse of ``dataclasses.asdict``.

        Raises:
            TypeError: a field is missing or unknown. ValueError: a ratio outside [0, 1].
        """
        data = dict(data)
        data["scores"] = [RatioScore(**s) for s in data.get("scores", [])]
        cal = cls(**data)
        if cal.ratio is not None and not 0.0 <= float(cal.ratio) <= 1.0:
            raise ValueError(f"calibrated ratio {cal.ratio} is outside [0, 1]")
        return cal


def _calibration_key(model_fingerprint: str, selection: str) -> str:
    return f"{model_fingerprint}/{selection}"


def read_calibration(index_path: str | os.PathLike[str], model_fingerprint: str,
                     selection: str) -> Calibration | None:
    """The index's calibration for this model and selection from its ``calibration.json``, or None
    (none recorded; an unreadable file is logged as a warning and also gives None)."""
    path = Path(index_path) / CALIBRATION
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data.get(_calibration_key(model_fingerprint, selection))
        return Calibration.from_dict(entry) if entry else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("cannot read %s (%s); run `ragcache calibrate` again", path, exc)
        return None


def write_calibration(index_path: str | os.PathLike[str], cal: Calibration) -> Path:
    """Record ``cal`` in the index folder's ``calibration.json`` (atomically; other models' and
    selections' entries kept). Returns the file's path.

    Raises:
        OSError: the folder cannot be written.
    """
    folder = Path(index_path)
    path = folder / CALIBRATION
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[_calibration_key(cal.model_fingerprint, cal.selection)] = asdict(cal)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path

