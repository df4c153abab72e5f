"""specedge: edge-cloud speculative decoding. The repository root is the `specedge` package; its folders
are the subpackages `specedge.edge`, `specedge.cloud`, `specedge.common` and `specedge.cli`."""

__version__ = "0.1.0"
