{{/* The release's base name: fullnameOverride, else "<release>-megascale-operator". */}}
{{- define "megascale-operator.fullname" -}}
{{- .Values.fullnameOverride | default (printf "%s-megascale-operator" .Release.Name) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "megascale-operator.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "megascale-operator.fullname" .) -}}
{{- end -}}

{{/* The image, tag defaulting to the chart's appVersion. */}}
{{- define "megascale-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Labels of every object of the chart. */}}
{{- define "megascale-operator.labels" -}}
app.kubernetes.io/part-of: megascale
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
