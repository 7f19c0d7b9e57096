"""CuTe DSL kernels: one module per kernel, with their mask / softmax / block-info helpers beside them."""
