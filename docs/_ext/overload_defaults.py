"""A Griffe extension for the docs build: parameters show the defaults their overloads state.

An implementation behind ``@overload`` signatures may take ``None`` for "not given"
(``@batched`` must tell ``max_batch_size=32`` passed beside a ``batcher`` from no value
at all), while its overloads state the default a caller gets. The reference's
parameter table reads each default from the implementation; this copies the default
an overload states (anything but ``...``) onto the implementation's parameter of the
same name, so the table and the signatures agree. mkdocs.yml loads it.
"""

from __future__ import annotations

from typing import Any

import griffe


class OverloadDefaults(griffe.Extension):
    """Give each parameter of an overloaded function the default its overloads state."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        """Copy the overloads' stated defaults onto ``func``'s parameters.

        Args:
            func: A function just read from its source; its overloads are attached.
            **kwargs: The rest of Griffe's hook arguments (unused).
        """
        for overload in func.overloads or ():
            for parameter in overload.parameters:
                stated = parameter.default
                if stated is None or str(stated) == "..." or parameter.name not in func.parameters:
                    continue
                func.parameters[parameter.name].default = stated
