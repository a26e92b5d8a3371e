"""What runs where the GPU is: model runner, step inputs and staging, block tables, CUDA graphs,
sampler."""
