"""The synchronous engine core. Importing it asks torch's CPU allocator for transparent huge pages
(before torch's first allocation, see ``sidecar.model.hugepages``), so ``LLM()`` users get the memory
setup the ``sidecar`` command gets from glibc."""

from sidecar.model import hugepages

hugepages.enable_torch_allocator()
