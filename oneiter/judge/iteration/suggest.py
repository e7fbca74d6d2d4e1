"""`oneiter compare --suggest`: from a screening comparison (`--level stats`) to the region to record in full.

The region is the first divergence's module inside its parent: the parent container (whose own code computes the
module's inputs, and which local blame judges as a container) and everything under it. Recording that region in
full on both sides (`--include REGEX`; weights, batch and gradients are recorded at any `--include`) is enough for
local blame to name the culprit among those modules, or to say the parent's own code is clean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from oneiter.format.schema import ROOT_MODULE

__all__ = ["Suggestion", "suggest_region"]


@dataclass(frozen=True)
class Suggestion:
    row: int  # index of the first divergence in the result's rows
    module: str  # its module ("(root)" for the model)
    region: str  # the module whose subtree to record ("" for the whole model)
    include: Optional[str]  # the --include regex, None when the whole model is the region

    def lines(self, reference: str, target: str) -> list[str]:
        """What `compare --suggest` prints: the region and the two commands that record it in full."""
        where = f"'{self.region}' and everything under it" if self.region else "the whole model"
        include = f" --include '{self.include}'" if self.include else ""
        return [
            f"first divergence in {self.module}: record {where} in full on both sides, then compare them:",
            f"  oneiter record <the reference's options>{include} -o {_stem(reference)}.region.h5",
            f"  oneiter record --replay {_stem(reference)}.region.h5 <the target's options>{include} "
            f"-o {_stem(target)}.region.h5",
            f"  oneiter compare {_stem(reference)}.region.h5 {_stem(target)}.region.h5",
        ]


def suggest_region(result) -> Optional[Suggestion]:
    """The region around `result`'s first divergence, or None when nothing diverged."""
    index = result.first_divergence
    if index is None:
        return None
    module = result.rows[index].module
    path = "" if module == ROOT_MODULE else module
    region = path.rpartition(".")[0] if "." in path else path
    if not region:  # a top-level module or the root: its parent is the model itself
        region = path
    include = f"^{re.escape(region)}(\\.|$)" if region else None
    return Suggestion(row=index, module=module, region=region, include=include)


def _stem(path: str) -> str:
    text = str(path)
    return text[:-3] if text.endswith(".h5") else text
