#!/bin/sh
# Write /conf/zoo.cfg (and /data/myid) from the environment, then run ZooKeeper in the
# foreground (QuorumPeerMain: standalone with one server, a member with ZOO_SERVERS).
set -eu
cfg=/conf/zoo.cfg
{
  echo "dataDir=/data"
  echo "clientPort=2181"
  echo "tickTime=${ZOO_TICK_TIME:-2000}"
  echo "initLimit=${ZOO_INIT_LIMIT:-10}"
  echo "syncLimit=${ZOO_SYNC_LIMIT:-5}"
  echo "4lw.commands.whitelist=${ZOO_4LW_COMMANDS_WHITELIST:-ruok,srvr,stat,mntr,conf}"
  echo "admin.enableServer=false"
  echo "standaloneEnabled=${ZOO_STANDALONE_ENABLED:-true}"
  echo "quorumListenOnAllIPs=true"
  for server in ${ZOO_SERVERS:-}; do echo "$server"; done
  for extra in ${ZOO_CFG_EXTRA:-}; do echo "$extra"; done
} > "$cfg"
echo "${ZOO_MY_ID:-1}" > /data/myid
printf '%s\n' "log4j.rootLogger=${ZOO_LOG_LEVEL:-INFO}, CONSOLE" \
  "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender" \
  "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout" \
  "log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} [myid:%X{myid}] %-5p [%t] %c{1}@%L - %m%n" \
  > /conf/log4j.properties
# zookeeper.jar's manifest names its dependencies; one slf4j binding, log4j 1.2 with the
# config above (on "/usr/share/java/*" slf4j would pick any of the five bindings there,
# slf4j-nop first, and the server would log nothing)
j=/usr/share/java
exec java -Xmx${ZOO_HEAP:-256m} -Dzookeeper.log.dir=/data \
  -Dlog4j.configuration=file:/conf/log4j.properties \
  -cp "$j/zookeeper.jar:$j/zookeeper-jute.jar:$j/slf4j-log4j12.jar:$j/log4j-1.2.jar" \
  org.apache.zookeeper.server.quorum.QuorumPeerMain "$cfg"
