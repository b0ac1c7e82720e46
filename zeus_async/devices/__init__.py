"""Hardware access: the only package that touches devices."""
