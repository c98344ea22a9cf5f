"""The tier service: per-execution history. Its group commit of appends and the service
object the tier face calls (:mod:`~cmdbus_trio.tier.committer`), and its retention
(:mod:`~cmdbus_trio.tier.retention`). Storage: :mod:`cmdbus_trio.storage.tier`; the
face: :mod:`cmdbus_trio.faces.tier`; the codec: :mod:`cmdbus_trio.protocol.tier`."""
