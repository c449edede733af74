"""Runtimes: SGLang servers on CPU or GPU, the CPU shim, model provisioning, the roofline memory plan."""
