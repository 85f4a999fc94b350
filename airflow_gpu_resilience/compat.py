"""The Airflow names the provider uses, imported from where each supported version keeps them.

One codebase runs on Airflow 2.11.x and on 3.0 through 3.3. Airflow 3 moved the authoring
interface into the Task SDK (``airflow.sdk``); Airflow 2.11 keeps it in ``airflow.models``,
``airflow.sensors``, ``airflow.decorators`` and ``airflow.utils.context``. Every module of the
provider and the example DAGs import those names from here, and nothing else in the package
looks at the Airflow version.

Names:

- authoring: :data:`BaseOperator`, :data:`BaseSensorOperator`, :data:`PokeReturnValue`,
  :data:`BaseOperatorLink`, :data:`DAG`, :data:`Param`, :data:`task`, :data:`Context` (a class on
  Airflow 2, a ``TypedDict`` on 3: use it in annotations only);
- triggers: :data:`BaseTrigger`, :data:`TriggerEvent` (``airflow.triggers.base`` on every version);
- exceptions: :data:`AirflowException`, :data:`AirflowFailException`, :data:`AirflowSensorTimeout`,
  :data:`TaskDeferred`;
- XCom read by the extra links: :func:`xcom_value`;
- configuration: :func:`default_deferrable`;
- :data:`AIRFLOW_VERSION` and :data:`AIRFLOW_V_3_0_PLUS`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from airflow import __version__ as _airflow_version

#: The installed Airflow's release (``Version("2.11.2")``), pre-release and local parts dropped.
AIRFLOW_VERSION = Version(Version(_airflow_version).base_version)
#: ``True`` on Airflow 3.0 and later (the Task SDK is the authoring interface).
AIRFLOW_V_3_0_PLUS = AIRFLOW_VERSION >= Version("3.0.0")

if AIRFLOW_V_3_0_PLUS:
    from airflow.sdk import (
        DAG,
        BaseOperator,
        BaseOperatorLink,
        BaseSensorOperator,
        Param,
        PokeReturnValue,
        task,
    )
    from airflow.sdk import Context

    try:  # the Task SDK's own exceptions (Airflow 3.1 and later)
        from airflow.sdk.exceptions import (
            AirflowException,
            AirflowFailException,
            AirflowSensorTimeout,
            TaskDeferred,
        )
    except ImportError:  # Airflow 3.0 keeps them in airflow.exceptions
        from airflow.exceptions import (  # type: ignore[no-redef]
            AirflowException,
            AirflowFailException,
            AirflowSensorTimeout,
            TaskDeferred,
        )
else:  # Airflow 2.11
    from airflow.decorators import task
    from airflow.exceptions import (
        AirflowException,
        AirflowFailException,
        AirflowSensorTimeout,
        TaskDeferred,
    )
    from airflow.models.baseoperator import BaseOperator
    from airflow.models.baseoperatorlink import BaseOperatorLink as _Airflow2OperatorLink
    from airflow.models.dag import DAG
    from airflow.models.param import Param
    from airflow.sensors.base import BaseSensorOperator, PokeReturnValue
    from airflow.utils.context import Context  # type: ignore[assignment]

from airflow.triggers.base import BaseTrigger, TriggerEvent

if not AIRFLOW_V_3_0_PLUS:

    class BaseOperatorLink(_Airflow2OperatorLink):  # type: ignore[no-redef]
        """Airflow 2.11's ``BaseOperatorLink`` with Airflow 3's ``xcom_key``.

        Airflow 3 names the XCom that holds a link's URL ``_link_<class name>``; Airflow 2.11's
        base class has no such key. Links built on this class store and read the same key on
        both.
        """

        @property
        def xcom_key(self) -> str:
            """XCom key of the stored URL: ``_link_<class name>``."""
            return f"_link_{type(self).__name__}"

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey

__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_0_PLUS",
    "DAG",
    "AirflowException",
    "AirflowFailException",
    "AirflowSensorTimeout",
    "BaseOperator",
    "BaseOperatorLink",
    "BaseSensorOperator",
    "BaseTrigger",
    "Context",
    "Param",
    "PokeReturnValue",
    "TaskDeferred",
    "TriggerEvent",
    "default_deferrable",
    "task",
    "xcom_value",
]

#: The environment variable that sets ``[operators] default_deferrable``.
DEFAULT_DEFERRABLE_ENV = "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"


def xcom_value(*, key: str, ti_key: TaskInstanceKey) -> Any:
    """The XCom value a task instance pushed under ``key``, or ``None`` when it pushed none.

    Airflow 3 reads it through the Task SDK's ``XCom``; Airflow 2.11 through
    ``airflow.models.xcom.XCom`` (the metadata database).

    :param key: the XCom key.
    :param ti_key: the task instance's key, as Airflow passes it to ``BaseOperatorLink.get_link``.
    :return: the deserialized value, or ``None``.
    """
    try:  # Airflow 3: the Task SDK's XCom, which the API server serves links from
        from airflow.sdk.execution_time.xcom import XCom
    except ImportError:  # Airflow 2.11
        from airflow.models.xcom import XCom  # type: ignore[no-redef]
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
    from airflow.configuration import conf

    value = conf.getboolean("operators", "default_deferrable", fallback=fallback)
    if DEFAULT_DEFERRABLE_ENV in os.environ:
        return value
    try:
        builtin = str(conf.get_default_value("operators", "default_deferrable")).strip().lower() == "true"
    except Exception:  # no built-in default known: the value is the deployment's
        return value
    return value if value != builtin else fallback
