#!/bin/sh
# A complete kandevd agent in POSIX sh (see docs/agents.md).
#   agents: {default: {command: ["/path/to/examples/agents/agent.sh"]}}
# stdin holds one JSON object (the same JSON is in "$KANDEVD_INPUT").
request=$(cat)
if [ -z "$request" ]; then
    echo "agent: empty input; refusing to guess" >&2
    exit 2
fi
trap 'echo "agent: stopped" >&2; exit 143' TERM
echo "agent: run ${KANDEVD_RUN_ID:-none} session $KANDEVD_SESSION_ID in $(pwd)" >&2
sleep 0.1 &                 # the real work goes here (in the background, so TERM is
wait $!                     # acted on at once)
# The last line of stdout: the summary and the cost in cents.
printf '{"summary": "handled run %s", "cost_cents": 0}\n' "${KANDEVD_RUN_ID:-none}"
