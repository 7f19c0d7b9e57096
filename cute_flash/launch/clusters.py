"""How many thread-block clusters of each size a GPU runs at once: the driver's occupancy query
(cuOccupancyMaxActiveClusters), asked for a stand-in kernel that fits as many CTAs an SM as the
kernel to be launched.

A cluster's CTAs must share one GPC, and GPCs hold unequal numbers of SMs, so clusters of s CTAs
may use fewer than all SMs, how many fewer depending on s and on the GPU's GPCs (the counts
measured: docs/tuning/decode-splits.md, "Clusters the GPU holds at once"). The split count of
the Hopper KV-cache entry, whose splits merge inside one cluster, reads these counts.

The stand-in is an empty kernel loaded from PTX (a few milliseconds of driver JIT, once per
device and CTAs an SM); what bounds CTAs an SM is its dynamic shared memory, an SM's share.
Not while the stream captures a CUDA graph: loading and unloading the module there invalidated
the capture (cudaErrorStreamCaptureInvalidated at the next launch, a decode whose first call
was captured, 2026-12-03).
"""
from __future__ import annotations

import torch
from cuda.bindings import driver

_PTX = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry cluster_probe()\n{\n ret;\n}\n\0"
_known: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (device, CTAs an SM, max size): counts


def _value(result):
    """The value of a cuda.bindings call's (error, value...) result; raises on an error."""
    err, *value = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return value[0] if value else None


def resident_clusters(index: int, ctas_per_sm: int, max_size: int) -> tuple[int, ...] | None:
    """Clusters of 1..max_size CTAs resident at once on device `index` (entry s - 1) for a
    kernel of `ctas_per_sm` CTAs an SM; None where the driver cannot say (no cluster support,
    or a call refused, or not yet known while the current stream captures a graph), and the
    split count then assumes every SM takes part. Kept once known; a refusal is asked again on
    the next new call signature."""
    key = (index, ctas_per_sm, max_size)
    if key not in _known:
        if torch.cuda.is_current_stream_capturing():
            return None
        try:
            _known[key] = _query(*key)
        except RuntimeError:
            return None
    return _known[key]


def _query(index: int, ctas_per_sm: int, max_size: int) -> tuple[int, ...]:
    attr = driver.CUdevice_attribute
    _value(driver.cuInit(0))
    device = _value(driver.cuDeviceGet(index))
    if _value(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, device)) == 0:
        raise RuntimeError("no thread-block clusters on this device")
    per_sm = _value(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device))
    reserved = _value(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK, device))
    smem = per_sm // ctas_per_sm - reserved
    context = _value(driver.cuDevicePrimaryCtxRetain(device))
    _value(driver.cuCtxPushCurrent(context))
    module = None
    try:
        module = _value(driver.cuModuleLoadData(_PTX))
        kernel = _value(driver.cuModuleGetFunction(module, b"cluster_probe"))
        max_smem = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _value(driver.cuFuncSetAttribute(kernel, max_smem, smem))
        return tuple(_value(driver.cuOccupancyMaxActiveClusters(kernel, _config(size, smem)))
                     for size in range(1, max_size + 1))
    finally:
        if module is not None:
            driver.cuModuleUnload(module)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)


def _config(size: int, smem: int):
    """A launch of 128-thread CTAs in clusters of `size` (the query reads the cluster shape,
    block size and shared memory; the grid only has to be a whole number of clusters)."""
    cluster = driver.CUlaunchAttribute()
    cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    value = driver.CUlaunchAttributeValue()
    value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = size, 1, 1
    cluster.value = value
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = size, 1024, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
    config.sharedMemBytes = smem
    config.attrs = [cluster]
    config.numAttrs = 1
    return config
