{{/*
Names are truncated at 63 characters because some Kubernetes name fields are limited to that
(DNS-1123 labels).
*/}}
{{- define "prefix-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The engine and Redis names leave room for their suffix (and a StatefulSet ordinal). */}}
{{- define "prefix-router.engineName" -}}
{{- printf "%s-engine" (include "prefix-router.fullname" . | trunc 49 | trimSuffix "-") }}
{{- end }}

{{- define "prefix-router.redisName" -}}
{{- printf "%s-redis" (include "prefix-router.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "prefix-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.labels" -}}
helm.sh/chart: {{ include "prefix-router.chart" . }}
{{ include "prefix-router.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefix-router
{{- end }}

{{- define "prefix-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefix-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefix-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "prefix-router.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: repository[:tag][@digest]; the tag defaults to the appVersion. */}}
{{- define "prefix-router.imageRef" -}}
{{- $repo := .image.repository -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion | toString -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end }}

{{- define "prefix-router.image" -}}
{{- include "prefix-router.imageRef" (dict "image" .Values.image "root" .) }}
{{- end }}

{{- define "prefix-router.engineImage" -}}
{{- $img := dict "repository" (.Values.trialFleet.image.repository | default .Values.image.repository) "tag" (.Values.trialFleet.image.tag | default .Values.image.tag) "digest" "" -}}
{{- if not .Values.trialFleet.image.repository }}{{ $_ := set $img "digest" .Values.image.digest }}{{ end -}}
{{- include "prefix-router.imageRef" (dict "image" $img "root" .) }}
{{- end }}

{{/* Fully qualified DNS suffix of the release namespace. */}}
{{- define "prefix-router.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* Name of the Secret that holds the admin token. */}}
{{- define "prefix-router.adminSecretName" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin" (include "prefix-router.fullname" .)) }}
{{- end }}

{{/* Whether the router uses a Redis index. */}}
{{- define "prefix-router.usesRedis" -}}
{{- if or .Values.redis.enabled (eq .Values.index.type "redis") }}true{{ end }}
{{- end }}

{{/*
The --index value when it can be written in plain config (no Secret): "memory", the bundled
Redis, or the external URL. Empty when the URL comes from a Secret.
*/}}
{{- define "prefix-router.indexValue" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s:%d/0" (include "prefix-router.redisName" .) (include "prefix-router.svcSuffix" .) (int .Values.redis.port) -}}
{{- else if eq .Values.index.type "redis" -}}
{{- if .Values.index.redis.existingSecret -}}
{{- else if .Values.index.redis.url -}}
{{- .Values.index.redis.url -}}
{{- else -}}
{{- fail "index.type=redis needs index.redis.url, index.redis.existingSecret or redis.enabled=true" -}}
{{- end -}}
{{- else -}}
memory
{{- end -}}
{{- end }}

{{/* The model name the router serves. */}}
{{- define "prefix-router.model" -}}
{{- if .Values.router.model }}{{ .Values.router.model }}{{ else if .Values.trialFleet.enabled }}{{ .Values.trialFleet.modelName }}{{ end }}
{{- end }}

{{/* Hash seeds the router tries: the configured ones plus the trial fleet's. */}}
{{- define "prefix-router.hashSeeds" -}}
{{- $seeds := list -}}
{{- range .Values.router.hashSeeds }}{{ $seeds = append $seeds (toString .) }}{{ end -}}
{{- if .Values.trialFleet.enabled }}{{ $seeds = append $seeds (toString .Values.trialFleet.pythonHashSeed) }}{{ end -}}
{{- toJson ($seeds | uniq) -}}
{{- end }}

{{/*
One --engine value per engine, as a JSON list: URL[,events=tcp://H:P][,replay=tcp://H:P][,dp=N].
The trial fleet's pods are named through the headless Service, so each keeps its identity (and
its place in the index) across restarts.
*/}}
{{- define "prefix-router.engineSpecs" -}}
{{- $specs := list -}}
{{- range .Values.engines.static -}}
{{- $spec := .url -}}
{{- if .events }}{{ $spec = printf "%s,events=%s" $spec .events }}{{ end -}}
{{- if .replay }}{{ $spec = printf "%s,replay=%s" $spec .replay }}{{ end -}}
{{- if .dp }}{{ $spec = printf "%s,dp=%d" $spec (int .dp) }}{{ end -}}
{{- if not (kindIs "invalid" .hash_seed) }}{{ $spec = printf "%s,hash_seed=%v" $spec .hash_seed }}{{ end -}}
{{- $specs = append $specs $spec -}}
{{- end -}}
{{- if .Values.trialFleet.enabled -}}
{{- $name := include "prefix-router.engineName" . -}}
{{- $suffix := include "prefix-router.svcSuffix" . -}}
{{- $p := .Values.trialFleet.ports -}}
{{- range $i := until (int .Values.trialFleet.replicas) -}}
{{- $host := printf "%s-%d.%s.%s" $name $i $name $suffix -}}
{{- $specs = append $specs (printf "http://%s:%d,events=tcp://%s:%d,replay=tcp://%s:%d" $host (int $p.http) $host (int $p.events) $host (int $p.replay)) -}}
{{- end -}}
{{- end -}}
{{- toJson $specs -}}
{{- end }}

{{/* --discovery value for a headless Service, or empty: dns://NAME:HTTP_PORT?events=P&replay=P[&dp=N]. */}}
{{- define "prefix-router.discovery" -}}
{{- $d := .Values.engines.discovery -}}
{{- if $d.enabled -}}
{{- if not $d.service }}{{ fail "engines.discovery.enabled needs engines.discovery.service" }}{{ end -}}
{{- $ns := $d.namespace | default .Release.Namespace -}}
{{- $q := printf "events=%d&replay=%d" (int $d.eventsPort) (int $d.replayPort) -}}
{{- if gt (int $d.dp) 1 }}{{ $q = printf "%s&dp=%d" $q (int $d.dp) }}{{ end -}}
{{- printf "dns://%s.%s.svc.%s:%d?%s" $d.service $ns .Values.clusterDomain (int $d.httpPort) $q -}}
{{- end -}}
{{- end }}

{{/* The router's config.yaml: everything but the engine sources (in args) and the secrets (in env). */}}
{{- define "prefix-router.config" -}}
{{- $cfg := dict "host" "0.0.0.0" "port" (int .Values.router.port) "log_level" .Values.router.logLevel "block_size" (int .Values.router.blockSize) "hash_scheme" .Values.router.hashScheme -}}
{{- $seeds := include "prefix-router.hashSeeds" . | fromJsonArray -}}
{{- /* The router takes one seed (hash_seed) and extra candidates tried on a mismatch (hash_seeds). */}}
{{- if $seeds }}{{ $_ := set $cfg "hash_seed" (first $seeds) }}{{ end -}}
{{- if gt (len $seeds) 1 }}{{ $_ := set $cfg "hash_seeds" (rest $seeds) }}{{ end -}}
{{- $model := include "prefix-router.model" . -}}
{{- if $model }}{{ $_ := set $cfg "model" $model }}{{ end -}}
{{- if .Values.router.tokenizer }}{{ $_ := set $cfg "tokenizer" .Values.router.tokenizer }}{{ end -}}
{{- $index := include "prefix-router.indexValue" . -}}
{{- if $index }}{{ $_ := set $cfg "index" $index }}{{ end -}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.router.config)) -}}
{{- end }}
