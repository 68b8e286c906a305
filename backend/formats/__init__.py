"""Weight formats: quantized codecs and the weight sources (safetensors, GGUF, int8) the engine
and the converter read tensors through."""
