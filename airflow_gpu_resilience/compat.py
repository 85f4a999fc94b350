"""What the provider needs from Airflow beyond ``airflow.providers.common.compat``.

One codebase runs on Airflow 2.11.x and on 3.0 through 3.3. The names whose home moved between
them (``BaseOperator``, ``BaseSensorOperator``, ``PokeReturnValue``, ``BaseOperatorLink``,
``Context``, ``DAG``, ``Param``, ``task``, ``XCom``, ``conf``, ``TaskInstanceKey`` and the
exceptions) come from ``airflow.providers.common.compat.sdk``, Airflow's own compatibility layer
(the ``apache-airflow-providers-common-compat`` distribution, 1.13.0 or later, the first release
that has every one of them): it takes each from the Task SDK (``airflow.sdk``) on Airflow 3 and
from ``airflow.models``, ``airflow.sensors``, ``airflow.decorators`` or ``airflow.exceptions`` on
2.11. The provider's modules and the example DAGs import them from there. ``BaseTrigger`` and
``TriggerEvent`` are in ``airflow.triggers.base`` on every version.

This module keeps only what that layer does not give:

- :data:`AIRFLOW_VERSION` and :data:`AIRFLOW_V_3_0_PLUS`: the provider's own version check (each
  provider keeps its own, as the common.compat provider asks of them);
- :class:`BaseOperatorLink`: Airflow's, with Airflow 3's ``xcom_key`` on 2.11 too;
- :func:`xcom_value`: the XCom value an extra link reads;
- :func:`default_deferrable`: the operators' default of ``deferrable``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from airflow.providers.common.compat.sdk import BaseOperatorLink as _AirflowOperatorLink
from packaging.version import Version

from airflow import __version__ as _airflow_version

if TYPE_CHECKING:
    from airflow.providers.common.compat.sdk import TaskInstanceKey

#: The installed Airflow's release (``Version("2.11.2")``), pre-release and local parts dropped.
AIRFLOW_VERSION = Version(Version(_airflow_version).base_version)
#: ``True`` on Airflow 3.0 and later (the Task SDK is the authoring interface).
AIRFLOW_V_3_0_PLUS = AIRFLOW_VERSION >= Version("3.0.0")

if AIRFLOW_V_3_0_PLUS:
    BaseOperatorLink = _AirflowOperatorLink
else:  # Airflow 2.11

    class BaseOperatorLink(_AirflowOperatorLink):  # type: ignore[no-redef]
        """Airflow 2.11's ``BaseOperatorLink`` with Airflow 3's ``xcom_key``.

        Airflow 3 names the XCom that holds a link's URL ``_link_<class name>``; Airflow 2.11's
        base class has no such key. Links built on this class store and read the same key on
        both.
        """

        @property
        def xcom_key(self) -> str:
            """XCom key of the stored URL: ``_link_<class name>``."""
            return f"_link_{type(self).__name__}"


__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_0_PLUS",
    "BaseOperatorLink",
    "default_deferrable",
    "xcom_value",
]

#: The environment variable that sets ``[operators] default_deferrable``.
DEFAULT_DEFERRABLE_ENV = "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"


def xcom_value(*, key: str, ti_key: TaskInstanceKey) -> Any:
    """The XCom value a task instance pushed under ``key``, or ``None`` when it pushed none.

    ``XCom`` is the Task SDK's on Airflow 3 (the API server serves links from it) and
    ``airflow.models.xcom.XCom`` (the metadata database) on 2.11, both through common.compat.

    :param key: the XCom key.
    :param ti_key: the task instance's key, as Airflow passes it to ``BaseOperatorLink.get_link``.
    :return: the deserialized value, or ``None``.
    """
    from airflow.providers.common.compat.sdk import XCom

    return XCom.get_value(key=key, ti_key=ti_key)


def default_deferrable(fallback: bool) -> bool:
    """The default of an operator's ``deferrable``: ``[operators] default_deferrable`` when the
    deployment sets it, else ``fallback``.

    Airflow's own default of the option is ``False``, and the Google provider's operators use it
    as their default directly; the sensor does the same (``fallback=False``). The execute
    operator, whose jobs run for hours, keeps deferring by default (``fallback=True``) unless the
    deployment sets the option:

    - the ``AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE`` environment variable, ``True`` or ``False``,
      always counts;
    - a value in ``airflow.cfg`` (or a secrets/command form of it) counts when it differs from
      Airflow's built-in default. Airflow 3 writes every default into the ``airflow.cfg`` it
      generates, so a ``False`` there cannot be told from the generated file.

    It is read once, when the operator's module is imported, as the Google provider's operators
    do.

    :param fallback: the default when the deployment does not set the option.
    :return: the value of ``deferrable`` for an operator that is not given one.
    """
    from airflow.providers.common.compat.sdk import conf

    value = conf.getboolean("operators", "default_deferrable", fallback=fallback)
    if DEFAULT_DEFERRABLE_ENV in os.environ:
        return value
    try:
        builtin = str(conf.get_default_value("operators", "default_deferrable")).strip().lower() == "true"
    except Exception:  # no built-in default known: the value is the deployment's
        return value
    return value if value != builtin else fallback
