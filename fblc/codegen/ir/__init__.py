"""The kernel IR: typed values and statements that emitters build and only the renderer turns into C
(docs/ARCHITECTURE.md §3). Nodes compare by structure, so two kernels built alike are equal IR (kernel
de-duplication); a variable is its kind and its number within its kernel (`Numbering`), not its Python identity.
"""

from fblc.codegen.ir import expressions, statements
from fblc.codegen.ir.expressions import *  # noqa: F401,F403 (the API: expressions.__all__)
from fblc.codegen.ir.statements import *  # noqa: F401,F403 (the API: statements.__all__)

__all__ = expressions.__all__ + statements.__all__
