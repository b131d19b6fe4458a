"""The Verifier: judges a candidate solution. This package holds the static anti-hacking analysis
(:func:`analyze`), which reads a candidate's Python and CUDA source without running it.
"""

from __future__ import annotations

from .static import MAJOR, MINOR, Finding, analyze

__all__ = ["analyze", "Finding", "MAJOR", "MINOR"]
