from amk.errors import *  # noqa
