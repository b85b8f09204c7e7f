#!/bin/bash
# start-rgw.sh DIR -> a single-node Ceph radosgw on 127.0.0.1; writes DIR/env (TEST_S3_*). As root, ~15 s.
# From shared/notes/servers.md: v2 monmap, memstore OSD, auth none with crc client mode.
set -euo pipefail
D=${1:?dir}
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
MONPORT=$(free_port); RGWPORT=$(free_port)
rm -rf "$D"; mkdir -p "$D"/{mon.a,osd.0,run,log}
FSID=$(cat /proc/sys/kernel/random/uuid)
cat > "$D/ceph.conf" <<CONF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MONPORT]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
mon data avail warn = 1
auth cluster required = none
auth service required = none
auth client required = none
run dir = $D/run
pid file = $D/run/\$name.pid
admin socket = $D/run/\$name.asok
log file = $D/log/\$name.log
keyring = $D/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd objectstore = memstore
memstore device bytes = 8589934592
mon data = $D/\$name
osd data = $D/\$name
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$RGWPORT
rgw dns name = localhost
ms mon client mode = crc
CONF
C="-c $D/ceph.conf"
ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MONPORT]" "$D/monmap" >/dev/null
ceph-mon $C -i a --mkfs --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon $C -i a
OSDUUID=$(cat /proc/sys/kernel/random/uuid); OSDID=$(timeout 60 ceph $C osd new "$OSDUUID")
ceph-osd $C -i "$OSDID" --mkfs --osd-uuid "$OSDUUID" 2>>"$D/log/mkfs.log"
ceph-osd $C -i "$OSDID"
radosgw $C -n client.rgw
for i in $(seq 1 300); do curl -s -o /dev/null "http://127.0.0.1:$RGWPORT/" && break; sleep 0.2; done
timeout 60 radosgw-admin $C user create --uid=test --display-name=test --access-key=testkey --secret=testsecret >/dev/null
cat > "$D/env" <<ENV
export TEST_S3_ENDPOINT=http://127.0.0.1:$RGWPORT TEST_S3_KEY=testkey TEST_S3_SECRET=testsecret
ENV
