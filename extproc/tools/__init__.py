"""Tools for people: ``policy explain``, ``policy diff`` and ``top``. They read the core and the
policy; nothing in the running service imports them."""
