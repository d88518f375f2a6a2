#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the launch tests and for trying the Slurm launchers.
#
#   slurm/local_cluster.sh start   install what is missing (Debian/Ubuntu, root or sudo), then start it
#   slurm/local_cluster.sh check   exit 0 when it answers (sinfo, sacct) and every node is up
#   slurm/local_cluster.sh stop    stop the daemons this script started (by their pid files)
#
# What it starts, all on 127.0.0.1:
#   munged; MariaDB on port 3307 (its own data directory); slurmdbd (so sacct works: submitit and
#   TorchX poll sacct, and without accounting a cancelled job is never seen to end); slurmctld; and
#   NUM_NODES slurmd, one per virtual node nodeK (NodeAddr=127.0.0.1, Port=1700K), named in /etc/hosts.
# Why several virtual nodes: Slurm never puts two components of a heterogeneous job on one node (the
# job would stay pending forever), and the rollout and trainer node groups are two components. Why
# backfill with bf_hetjob_immediate: only the backfill scheduler starts het jobs. No cgroups here,
# hence proctrack/linuxproc and task/none. Each virtual node advertises CPUS_PER_NODE CPUs whatever
# the machine has (config_overrides), so jobs oversubscribe a small machine rather than wait.
#
# It writes /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf (refusing to touch ones it did not
# write) and keeps its state under $STATE_DIR. Settings: RP_SLURM_NODES (default 4),
# RP_SLURM_CPUS_PER_NODE (default 4), RP_SLURM_STATE_DIR (default /var/lib/rolloutpipe-slurm).
set -euo pipefail

NUM_NODES=${RP_SLURM_NODES:-4}
CPUS_PER_NODE=${RP_SLURM_CPUS_PER_NODE:-4}
STATE_DIR=${RP_SLURM_STATE_DIR:-/var/lib/rolloutpipe-slurm}
CLUSTER=rolloutpipe
MARKER="# Written by rolloutpipe slurm/local_cluster.sh"
DB_PORT=3307
SLURM_CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
NODES=$(seq -f "node%g" 1 "$NUM_NODES" | paste -sd' ')

if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi
say() { echo "local_cluster: $*" >&2; }
die() { say "$*"; exit 1; }
as_root() { "${SUDO[@]}" "$@"; }

# Wait up to $1 seconds for "$2..." to succeed.
wait_for() {
    local timeout=$1; shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.5
    done
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    [ ${#missing[@]} -eq 0 ] && return
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install them by hand."
    say "installing ${missing[*]} (apt-get)"
    as_root apt-get update -qq
    # policy-rc.d may refuse to start the services: this script starts them itself.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

check_owned() {  # refuse to overwrite a configuration this script did not write
    local file=$1
    if [ -e "$file" ] && ! head -1 "$file" | grep -qF "$MARKER"; then
        die "$file exists and was not written by this script; this machine may be part of a real cluster. Not touching it."
    fi
}

write_hosts() {  # the virtual nodes' names, on one line of our own (rewritten in place: /etc/hosts may be a mount)
    local tmp; tmp=$(mktemp)
    grep -v "# rolloutpipe-local-slurm" /etc/hosts > "$tmp" || true
    echo "127.0.0.1 $NODES # rolloutpipe-local-slurm" >> "$tmp"
    as_root sh -c "cat '$tmp' > /etc/hosts"
    rm -f "$tmp"
}

write_configs() {
    check_owned "$SLURM_CONF"
    check_owned "$DBD_CONF"
    as_root install -d -o slurm -g slurm -m 0700 "$STATE_DIR/ctld"
    as_root install -d -o slurm -g slurm -m 0755 "$STATE_DIR/log" "$STATE_DIR/run"
    as_root install -d -o root -g root -m 0755 "$STATE_DIR/slurmd"
    as_root install -d -o root -g root -m 0700 "$STATE_DIR/secrets"
    if ! as_root test -s "$STATE_DIR/secrets/db_password"; then
        as_root sh -c "head -c 18 /dev/urandom | base64 | tr -d '/+=' > '$STATE_DIR/secrets/db_password'"
    fi
    local db_password; db_password=$(as_root cat "$STATE_DIR/secrets/db_password")
    local controller; controller=$(hostname -s)
    # Every virtual node offers (almost) the whole machine's memory: memory is not a consumable here
    # (CR_CPU), but requests larger than RealMemory are refused.
    local memory_mb; memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    local tmp; tmp=$(mktemp)
    {
        echo "$MARKER: a one-machine test cluster."
        echo "ClusterName=$CLUSTER"
        echo "SlurmctldHost=$controller(127.0.0.1)"
        echo "SlurmUser=slurm"
        echo "AuthType=auth/munge"
        echo "StateSaveLocation=$STATE_DIR/ctld"
        echo "SlurmdSpoolDir=$STATE_DIR/slurmd/%n"
        echo "SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid"
        echo "SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$STATE_DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MpiDefault=none"
        echo "SchedulerType=sched/backfill"
        echo "SchedulerParameters=bf_interval=1,bf_hetjob_immediate"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "AccountingStorageType=accounting_storage/slurmdbd"
        echo "AccountingStorageHost=127.0.0.1"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        echo "KillWait=5"
        echo "MinJobAge=60"
        echo "InactiveLimit=0"
        echo "SlurmctldTimeout=30"
        echo "SlurmdTimeout=60"
        for k in $(seq 1 "$NUM_NODES"); do
            echo "NodeName=node$k NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((17000 + k)) CPUs=$CPUS_PER_NODE RealMemory=$memory_mb State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=node[1-$NUM_NODES] Default=YES MaxTime=INFINITE State=UP"
    } > "$tmp"
    as_root install -o root -g root -m 0644 "$tmp" "$SLURM_CONF"
    {
        echo "$MARKER: accounting for the one-machine test cluster."
        echo "AuthType=auth/munge"
        echo "DbdHost=localhost"
        echo "DbdAddr=127.0.0.1"
        echo "SlurmUser=slurm"
        echo "PidFile=$STATE_DIR/run/slurmdbd.pid"
        echo "LogFile=$STATE_DIR/log/slurmdbd.log"
        echo "StorageType=accounting_storage/mysql"
        echo "StorageHost=127.0.0.1"
        echo "StoragePort=$DB_PORT"
        echo "StorageUser=slurm"
        echo "StoragePass=$db_password"
        echo "StorageLoc=slurm_acct_db"
    } > "$tmp"
    # slurmdbd insists on its config being private to SlurmUser: it holds the database password.
    as_root install -o slurm -g slurm -m 0600 "$tmp" "$DBD_CONF"
    rm -f "$tmp"
}

alive() {  # pid file names a running process
    local pid; pid=$(as_root cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && as_root kill -0 "$pid" 2>/dev/null
}

start_munge() {
    as_root install -d -o munge -g munge -m 0755 /run/munge
    if ! as_root test -s /etc/munge/munge.key; then
        as_root runuser -u munge -- mungekey --create
    fi
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then  # else a munged is running already: leave it be
        as_root runuser -u munge -- munged
        wait_for 20 sh -c 'munge -n | unmunge' || die "munged did not start"
        as_root cp /run/munge/munged.pid "$STATE_DIR/run/munged.pid"
    fi
}

db() { as_root mariadb --socket="$STATE_DIR/db-run/mysql.sock" -u root "$@"; }

start_mariadb() {
    if ! as_root test -d "$STATE_DIR/mysql/mysql"; then
        as_root install -d -o mysql -g mysql -m 0700 "$STATE_DIR/mysql"
        as_root mariadb-install-db --user=mysql --datadir="$STATE_DIR/mysql" \
            --auth-root-authentication-method=socket >"$STATE_DIR/log/mariadb-install.log" 2>&1 || \
            die "mariadb-install-db failed; see $STATE_DIR/log/mariadb-install.log"
    fi
    if ! alive "$STATE_DIR/run/mariadb.pid"; then
        as_root install -d -o mysql -g mysql -m 0755 "$STATE_DIR/db-run"
        # --no-defaults: never read the machine's own MariaDB configuration; a separate port and socket.
        as_root sh -c "nohup mariadbd --no-defaults --user=mysql --datadir='$STATE_DIR/mysql' \
            --port=$DB_PORT --bind-address=127.0.0.1 --socket='$STATE_DIR/db-run/mysql.sock' \
            --pid-file='$STATE_DIR/db-run/mariadb.pid' --innodb-buffer-pool-size=64M \
            --log-error='$STATE_DIR/db-run/mariadb.log' >/dev/null 2>&1 & echo \$! > '$STATE_DIR/run/mariadb.pid'"
        wait_for 90 db -e "select 1" || die "MariaDB did not start; see $STATE_DIR/db-run/mariadb.log"
    fi
    local db_password; db_password=$(as_root cat "$STATE_DIR/secrets/db_password")
    db -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
           CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_password';
           ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_password';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    if ! alive "$STATE_DIR/run/slurmdbd.pid"; then
        as_root slurmdbd
        wait_for 60 sacctmgr -n show cluster || die "slurmdbd did not answer; see $STATE_DIR/log/slurmdbd.log"
    fi
    if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

start_slurm() {
    alive "$STATE_DIR/run/slurmctld.pid" || as_root slurmctld
    wait_for 30 scontrol ping || die "slurmctld did not answer; see $STATE_DIR/log/slurmctld.log"
    for k in $(seq 1 "$NUM_NODES"); do
        alive "$STATE_DIR/run/slurmd-node$k.pid" || as_root slurmd -N "node$k"
    done
    wait_for 60 nodes_up || die "nodes did not come up: $(sinfo -N -h 2>&1); see $STATE_DIR/log/slurmd-node*.log"
}

nodes_up() {  # every node idle, mixed or allocated (not down, drained or unknown)
    local states; states=$(sinfo -N -h -o "%N %t" 2>/dev/null) || return 1
    [ "$(echo "$states" | grep -cE " (idle|mix|alloc)$")" -eq "$NUM_NODES" ]
}

check() {
    head -1 "$SLURM_CONF" 2>/dev/null | grep -qF "$MARKER" || { say "$SLURM_CONF is not this script's"; return 1; }
    scontrol ping >/dev/null 2>&1 || { say "slurmctld does not answer"; return 1; }
    nodes_up || { say "not every node is up: $(sinfo -N -h -o '%N %t' | paste -sd' ')"; return 1; }
    sacct -n -X -S now >/dev/null 2>&1 || { say "sacct does not answer (slurmdbd)"; return 1; }
    getent hosts node1 >/dev/null || { say "node1 is not in /etc/hosts"; return 1; }
    say "up: $NUM_NODES nodes ($(sinfo -h -o '%D nodes %t' | paste -sd,)), accounting on"
}

stop_pidfile() {
    local file=$1
    alive "$file" || return 0
    local pid; pid=$(as_root cat "$file")
    as_root kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do as_root kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
    as_root kill -9 "$pid" 2>/dev/null || true
}

stop() {
    if command -v squeue >/dev/null && scontrol ping >/dev/null 2>&1; then  # every job: this cluster is ours
        squeue -h -o %A | xargs -r "${SUDO[@]}" scancel 2>/dev/null || true
    fi
    for k in $(seq 1 "$NUM_NODES"); do stop_pidfile "$STATE_DIR/run/slurmd-node$k.pid"; done
    stop_pidfile "$STATE_DIR/run/slurmctld.pid"
    stop_pidfile "$STATE_DIR/run/slurmdbd.pid"
    stop_pidfile "$STATE_DIR/run/mariadb.pid"
    stop_pidfile "$STATE_DIR/run/munged.pid"  # only if this script started it
    say "stopped"
}

case "${1:-}" in
    start)
        install_packages
        write_hosts
        write_configs
        start_munge
        start_mariadb
        start_slurmdbd
        start_slurm
        check
        ;;
    check) check ;;
    stop) stop ;;
    *) echo "usage: $0 start|check|stop" >&2; exit 2 ;;
esac
