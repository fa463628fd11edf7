"""streamdiloco: train one model on GPUs scattered across the internet, with Streaming DiLoCo.

This folder is the root package `streamdiloco` (pyproject.toml maps it); the code lives in the sibling
folders common/, server/, worker/, protos/ and sim/, which import as streamdiloco.common, ...
"""

__version__ = "0.1.0"
