"""What runs an exported ONNX artifact with numpy, PIL and ONNX Runtime alone: no torch, and of this
project only the torch-free engine modules (errors, files, paths). Below exporters/ and artifacts/,
which import it; tests/test_structure.py checks that importing any of it leaves torch out.

  runtime.spec        the artifact's description (`<artifact>.json`) parsed strictly
  runtime.integrity   the ONNX safety checks and the SHA-256 of the files, before a session opens
  runtime.panoptic    Panoptic FPN's fusion in numpy (`fuse`: a graph's outputs -> COCO panoptic ids and
                      segments), the COCO panoptic id codec and PNGs, PQ as panopticapi computes it
"""
