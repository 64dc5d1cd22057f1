"""Layer 3: quantization arithmetic: the KV block formats, KIVI's rotation, outliers and fitted levels, and
weight quantization through torchao."""
