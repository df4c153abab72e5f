"""specedge: edge-cloud speculative decoding. The repository root is the `specedge` package; its folders
are the subpackages `specedge.edge`, `specedge.cloud`, `specedge.common`, `specedge.cli` and `specedge.bench`."""

__version__ = "0.1.0"
