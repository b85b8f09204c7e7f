#!/bin/bash
# stop-rgw.sh DIR: stop what start-rgw.sh started.
D=${1:?dir}
for n in client.rgw osd.0 mon.a; do
  [ -f "$D/run/$n.pid" ] && kill "$(cat "$D/run/$n.pid")" 2>/dev/null
done
sleep 1
for n in client.rgw osd.0 mon.a; do
  [ -f "$D/run/$n.pid" ] && kill -9 "$(cat "$D/run/$n.pid")" 2>/dev/null
done
rm -rf "$D"
