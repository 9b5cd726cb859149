"""What `weightstream quantize` is asked to do, checked once: `QuantizeOptions`, a frozen dataclass that refuses
a combination the pipeline cannot honour (with what to change) before any file is opened.

The scheme itself is decided here where the options decide it (`--kernel torch`, 8 or 16 bits) and by the source
otherwise (4 bits on the native kernels: MXFP4 blocks kept, else Q4_K or Q4_1 by the inputs' sizes:
store/quant/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightstream import native
from weightstream.errors import WeightstreamError
from weightstream.store.quant.manifest import MISS_BITS
from weightstream.store.quant.torch_codes import INT4_GROUPS

DEFAULT_GROUP = 128  # torch int4: see docs/quantization.md for the measured choice
KERNELS = ("auto", "native", "torch")
DENSE_CHOICES = ("keep", "int8", "int4", "bf16")


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    """`bits` 8, 4 or 16 per expert weight; `group_size` torch int4's inputs per scale (None: DEFAULT_GROUP, and
    the native kernels where they are built); `kernel` auto, native or torch; `dense` keep, int8, int4 or bf16 for
    the dense linears; `miss_bits` 2 or 3 for small copies of each expert (None: none)."""

    bits: int
    group_size: int | None = None
    kernel: str = "auto"
    dense: str = "keep"
    miss_bits: int | None = None

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_native()

    def _check_choices(self) -> None:
        if self.bits not in (8, 4, 16):
            raise WeightstreamError(f"--bits {self.bits}: choose 8, 4 or 16")
        if self.kernel not in KERNELS:
            raise WeightstreamError(f"--kernel {self.kernel!r}: choose one of {', '.join(KERNELS)}")
        if self.dense not in DENSE_CHOICES:
            raise WeightstreamError(f"--dense {self.dense!r}: choose one of {', '.join(DENSE_CHOICES)}")
        if self.miss_bits is not None and self.miss_bits not in MISS_BITS:
            raise WeightstreamError(f"--miss-bits {self.miss_bits}: choose 2 (Q2_K small copies) or 3 (Q3_K)")
        torch_asked = self.kernel == "torch" or self.group_size is not None
        if self.bits == 16 and torch_asked:
            raise WeightstreamError("--bits 16 stores bf16 experts for the native kernels; drop --kernel torch")
        if self.kernel == "native" and self.group_size is not None:
            raise WeightstreamError(
                "--group-size is for --kernel torch; the native kernels use blocks of 32 (docs/kernels.md)"
            )
        if self.dense != "keep" and torch_asked:
            raise WeightstreamError(
                f"--dense {self.dense}: dense weights run on the native kernels only; drop --kernel torch"
            )
        if self.miss_bits is not None and torch_asked:
            raise WeightstreamError(
                f"--miss-bits {self.miss_bits}: small copies are GGML blocks (Q2_K / Q3_K) computed by the native "
                "kernels, beside native blobs; drop --kernel torch and --group-size"
            )
        if self.bits == 8 and self.group_size is not None:
            raise WeightstreamError("--group-size is for --bits 4; int8 experts have one scale per output channel")
        if self.scheme == "int4" and self.group not in INT4_GROUPS:
            raise WeightstreamError(
                f"--group-size {self.group}: torch's int4 kernel takes {', '.join(map(str, INT4_GROUPS))} "
                f"(leave it out for {DEFAULT_GROUP}; docs/quantization.md, 'Choosing the group size')"
            )

    def _check_native(self) -> None:
        """What needs the native kernels, refused where they are not built (with why not)."""
        if native.available():
            return
        needs = [
            (self.bits == 16, "--bits 16"),
            (self.dense != "keep", f"--dense {self.dense}"),
            (self.kernel == "native", "--kernel native"),
            (self.miss_bits is not None, f"--miss-bits {self.miss_bits}"),
        ]
        for asked, option in needs:
            if asked:
                raise WeightstreamError(f"{option}: the native kernels are not available here ({native.why_not()})")

    @property
    def use_torch(self) -> bool:
        """torch's packed layouts: asked for, implied by --group-size, or the only kernels built here."""
        return (
            self.kernel == "torch" or self.group_size is not None or (self.kernel == "auto" and not native.available())
        )

    @property
    def scheme(self) -> str | None:
        """int8 / int4 (torch), q8_0 / bf16 (native); None: native 4-bit, decided by the source."""
        if self.use_torch:
            return "int8" if self.bits == 8 else "int4"
        return {8: "q8_0", 16: "bf16"}.get(self.bits)

    @property
    def group(self) -> int:
        return DEFAULT_GROUP if self.group_size is None else self.group_size
