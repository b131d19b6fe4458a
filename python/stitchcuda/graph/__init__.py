"""Graph mode: a live nn.Module -> core-ATen graph (capture) -> groups with strategies (the offline
Planner) -> kernels (the template Coder) and program steps (lowering) -> a verified stitched Program.

`stitchcuda.optimize(model, args, kwargs)` runs the whole pipeline; the stages are usable alone.
"""

from .capture import CaptureError, Graph, Node, Value, capture
from .lower import Lowering, LoweringError, check_group, reference_values
from .optimize import OptimizedModule, Report, optimize
from .decode import StaticCacheGenerator, TransformersStaticCacheLM
from .planner import Group, OfflinePlanner, GraphPlan

__all__ = ["capture", "CaptureError", "Graph", "Node", "Value", "OfflinePlanner", "GraphPlan", "Group", "Lowering",
           "LoweringError", "check_group", "reference_values", "optimize", "OptimizedModule", "Report",
           "StaticCacheGenerator", "TransformersStaticCacheLM"]
