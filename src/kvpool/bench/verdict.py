"""One verdict type for every benchmark: a store target or a paper's claim, checked.

``kvpool bench store`` holds kvpool to performance targets (ratios against Mooncake,
Redis, memcpy and one TCP stream; node and client memory), ``kvpool bench cache`` checks the
Mooncake FAST'25 claims on prefix caching against its replay. Both report
:class:`Verdict` records; each benchmark keeps its own JSON keys (:meth:`Verdict.as_target`,
:meth:`Verdict.as_claim`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    """What was checked, against what, and whether it held.

    name: the target or claim in words; measured: the figure (a ratio, MiB, a hit
    rate; None: not measured, e.g. a column absent); target: the bound it is held to;
    met: True / False, None when not measured; detail: where it was measured (a table
    row) or the figures in words; higher_is_better: the direction of the bound.
    """

    name: str
    measured: float | None
    target: float
    met: bool | None = None
    detail: str = ""
    higher_is_better: bool = True

    @classmethod
    def bound(cls, name: str, measured: float | None, target: float, detail: str = "",
              higher_is_better: bool = True) -> "Verdict":
        """A verdict met when ``measured`` is at least (or, ``higher_is_better=False``, at
        most) ``target``; not measured when ``measured`` is None."""
        met = None if measured is None else (
            measured >= target if higher_is_better else measured <= target)
        return cls(name, measured, target, met, detail, higher_is_better)

    def as_target(self) -> dict:
        """The JSON record of a store target (``kvpool bench store``)."""
        return {"target": self.name, "row": self.detail, "value": self.measured,
                "threshold": self.target, "higher_is_better": self.higher_is_better,
                "met": self.met}

    def as_claim(self) -> dict:
        """The JSON record of a paper's claim (``kvpool bench cache``)."""
        return {"claim": self.name, "measured": self.detail, "holds": self.met}
