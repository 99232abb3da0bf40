"""The model and what runs it: the model directory's layout and configs
(``model_dir``), its tokenizer and chat template (``tokenizer``), the interface a
runtime hands the engine (``interface``: ``Slot``, ``PagedModel``, ``Models``), and the
runtimes behind it (``openvino``, ``onnxruntime``: the only modules that import one),
chosen and pooled by ``backend``. Imports nothing else of the engine."""
