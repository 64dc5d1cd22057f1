"""Layer 10: engine llama.cpp (llama-cpp-python over a GGUF file), its install and the GGUF a model runs as."""
