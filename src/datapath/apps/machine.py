"""What this machine offers: CUDA present or not, a label for the device, the machine's facts for a result file.

    from datapath.apps.machine import cuda_available, device_label, machine_info, require_cuda
    machine_info()        # {"gpu": ..., "torch": ..., "cuda": ..., "cpu": ..., ...}, written into results
    require_cuda("B1")    # the CUDA device, or CudaUnavailableError naming what needs it
    use_blocking_sync()   # host waits for CUDA sleep instead of spin; True when set
"""
from datapath._runtime.cuda_sched import use_blocking_sync
from datapath._runtime.device import cuda_available, device_label, machine_info, require_cuda

__all__ = ["cuda_available", "device_label", "machine_info", "require_cuda", "use_blocking_sync"]
