"""Model tooling: make and inspect the model directories qvld serves (no daemon involved).

``convert``      checkpoint -> OpenVINO IRs (optimum-intel), ``info``, ``verify``
``onnx_export``  checkpoint -> ONNX graphs for ``model.backend: onnxruntime``

`qvlctl model convert|info|verify|export-onnx` is their command line; qvlctl imports
this package only when a ``model`` command runs. The exporters need the ``convert``
extra (torch, transformers, optimum-intel, onnx), imported inside the functions that use
them: importing a module here loads none of them.
"""
