"""An OpenAI-compatible HTTP server on the continuous-batching scheduler (`python -m dsv4_model serve`).

chat_encoding: DeepSeek-V4's chat prompt; output_parser: model text -> reasoning / content / tool calls;
protocol: request fields and their checks; bridge: the scheduler thread <-> the event loop; app: the routes;
metrics: Prometheus; cli: the command line. Imports runtime (never the other way round)."""
