"""Test helpers that users can use too: the GPU simulator beneath pynvml, fake clocks, fake sysfs."""
