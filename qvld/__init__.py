"""qvld: a Qwen3-VL vision-language daemon for plain CPUs, on OpenVINO."""

__version__ = "0.1.0"
